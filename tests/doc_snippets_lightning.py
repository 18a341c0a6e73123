"""The fixtures of test_doc_snippets.py (see doc_snippets.py) that need Lightning: the Lightning pages'
names, and the models of examples/ (which import Lightning). Imported only for the blocks that name
one of them, never where Lightning is not installed."""

from __future__ import annotations

import torch
from doc_snippets import _assert_relative, _one_device_token_mean
from torch import nn


def _examples_module(name: str):
    """A module of examples/ (they import their _common.py as a top-level module)."""
    import importlib
    import sys

    examples = str(__import__("pathlib").Path(__file__).resolve().parent.parent / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    return importlib.import_module(name)


def lightning_names() -> dict:
    """What the Lightning page's blocks import at its top: ``L``, ``Trainer``, ``F``, ``torch``, the
    strategy and callback, the TP styles, ``MixedPrecisionPolicy`` and a ``TransformerBlock`` class."""
    import lightning as L
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from lightning_ndclip import GlobalNormClip, NDParallelStrategy

    class TransformerBlock(nn.Module):
        pass

    return {"L": L, "Trainer": L.Trainer, "F": nn.functional, "torch": torch, "NDParallelStrategy": NDParallelStrategy,
            "GlobalNormClip": GlobalNormClip, "ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel,
            "MixedPrecisionPolicy": MixedPrecisionPolicy, "TransformerBlock": TransformerBlock}


# --- the pipeline how-to: its three blocks in one namespace, the Trainer on 4 ranks ----------------


def pipeline_howto_names() -> dict:
    """The page's imports: ``nn``, ``torch``, ``F``, ``L``, the strategy and callback, and ``Block``
    (examples/train_gpt.py's: head-major fused qkv, causal attention)."""
    import lightning as L

    from lightning_ndclip import GlobalNormClip, NDParallelStrategy

    return {"nn": nn, "torch": torch, "F": nn.functional, "L": L, "NDParallelStrategy": NDParallelStrategy,
            "GlobalNormClip": GlobalNormClip, "Block": _examples_module("train_gpt").Block}


def _pipeline_rows() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, 64, (16, 12), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    labels[::3, 7:] = -100  # uneven valid tokens per row
    return tokens, labels


def pipeline_step_matches_one_device(ns: dict) -> None:
    """One optimizer step of the page's ``trainer`` on ``LitGPT`` (16 rows: 2 batches of 4 rows per
    data rank, 4 micro-batches each): the logged pre-clip norm and ``train_loss`` equal one device's
    token mean over the 16 rows (fp32, 1e-5)."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    tokens, labels = _pipeline_rows()
    trainer = ns["trainer"]
    trainer.fit_loop.epoch_loop.max_steps = 1
    torch.manual_seed(0)
    trainer.fit(ns["LitGPT"](), DataLoader(TensorDataset(tokens, labels), batch_size=4))
    torch.manual_seed(0)
    loss, norm = _one_device_token_mean(ns["GPT"](64, 64, 8, 4), tokens, labels)
    if dist.get_rank() == 0:  # GlobalNormClip logs from rank 0
        _assert_relative(trainer.callback_metrics["grad_norm/total"], norm, 1e-5)
        _assert_relative(trainer.callback_metrics["train_loss"], loss, 1e-5)


# --- the pure-PyTorch page: examples/train_gpt.py's GPT; torchrun's 4 ranks, FSDP2 x TP -------------


def _gpt_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 64, (8, 16), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = -100
    labels[1::3, 10:] = -100  # uneven valid tokens
    return tokens, labels


def gpt_and_loader() -> dict:
    """``GPT`` from examples/train_gpt.py; ``loader``: one optimizer step of two micro-batches of 2
    rows for this rank's dp_shard coordinate (tp peers get the same rows)."""
    import torch.distributed as dist

    tokens, labels = _gpt_data()
    dp = dist.get_rank() // 2  # mesh (dp_shard, tp) = (2, 2), row-major
    rows = list(range(4 * dp, 4 * dp + 4))
    micro_batches = [(tokens[rows[i : i + 2]], labels[rows[i : i + 2]]) for i in (0, 2)]
    return {"GPT": _examples_module("train_gpt").GPT, "loader": [micro_batches]}


def norm_matches_one_device(ns: dict) -> None:
    """The pre-clip norm the step logged equals one device's: the same GPT, the token mean over all
    8 rows (both micro-batches of both data ranks), fp32, 1e-5."""
    torch.manual_seed(0)
    model = ns["GPT"](vocab=64, width=64, layers=4, heads=4, seq_len=64)
    _, expected = _one_device_token_mean(model, *_gpt_data())
    _assert_relative(ns["norm"], expected, 1e-5)


def gpt_with_grads() -> dict:
    """``model``: examples/train_gpt.py's GPT (2 layers) with gradients from one backward; ``nd``."""
    import lightning_ndclip as nd

    torch.manual_seed(0)
    model = _examples_module("train_gpt").GPT(vocab=64, width=32, layers=2, heads=4, seq_len=16)
    tokens = torch.randint(0, 64, (2, 16))
    nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    return {"model": model, "nd": nd}
