"""What the documentation's prose gives a Python block before it runs, and the checks after it
(named in the ``<!-- run: before=... after=... -->`` comment above the block; see test_doc_snippets.py).
Those that need Lightning (or the examples, which import it) are in doc_snippets_lightning.py: this
module imports no Lightning, so the core-only run collects its blocks."""

from __future__ import annotations

import copy

import torch
from torch import nn


def _assert_relative(got: torch.Tensor | float, expected: torch.Tensor | float, rtol: float) -> None:
    assert abs(float(got) - float(expected)) <= rtol * float(expected), (float(got), float(expected))


def _one_device_token_mean(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain model on one device: the mean cross-entropy over every valid token, backpropagated;
    ``(loss, gradient norm)``."""
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    return loss, torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])


def _norm_before(ns: dict) -> torch.Tensor:
    """The float64 norm of the gradients the block started from."""
    return torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in ns["_grads_before"]]))


def tiny_model_with_grads() -> dict:
    """``model``: a small MLP with gradients from one backward (float32, norm about 3)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    (nn.functional.mse_loss(model(x), y, reduction="sum") / 4).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    return {"model": model, "_grads_before": grads}


def clip_matches_torch(ns: dict) -> None:
    """``total`` is the pre-clip norm of the gradients the block started from (float64 reference),
    and the gradients were scaled by ``min(1, 1 / (total + 1e-6))`` once, as max_norm=1.0 does."""
    expected = _norm_before(ns)
    assert expected > 1.0, "the fixture's gradients should need clipping"
    _assert_relative(ns["total"], expected, 1e-5)
    coef = min(1.0, 1.0 / (float(expected) + 1e-6))
    for p, g in zip(ns["model"].parameters(), ns["_grads_before"]):
        torch.testing.assert_close(p.grad, g * coef, rtol=1e-5, atol=1e-7)


def total_is_the_pre_clip_norm(ns: dict) -> None:
    """``total`` (the last one the block computed) is the norm of the gradients it started from."""
    _assert_relative(ns["total"], _norm_before(ns), 1e-5)
    assert 0 < float(ns["coef"]) <= 1.0


# --- context parallelism: 2 ranks, one cp group --------------------------------------------------


def _full_sequence() -> dict:
    g = torch.Generator().manual_seed(5)
    return {
        "tokens": torch.randint(0, 50, (2, 16), generator=g),
        "labels": torch.randint(0, 50, (2, 16), generator=g),
        "q": torch.randn(2, 2, 16, 4, generator=g, dtype=torch.float64),
        "k": torch.randn(2, 2, 16, 4, generator=g, dtype=torch.float64),
        "v": torch.randn(2, 2, 16, 4, generator=g, dtype=torch.float64),
        "sample_ids": torch.tensor([[0] * 6 + [1] * 8 + [-1] * 2, [0] * 16]),
    }


def cp_sequences() -> dict:
    """``tokens`` and ``labels`` ``[2, 16]``, the same full sequences on every rank; ``cp_rank``, ``cp_size``."""
    import torch.distributed as dist

    full = _full_sequence()
    return {"tokens": full["tokens"], "labels": full["labels"], "cp_rank": dist.get_rank(),
            "cp_size": dist.get_world_size(), "_full": full}


def shards_are_the_load_balanced_chunks(ns: dict) -> None:
    """Every position once over the ranks; each local token is the full sequence's at its position;
    chunks r and 2cp-1-r (equal causal work)."""
    import torch.distributed as dist

    full, positions = ns["_full"], ns["positions"]
    assert torch.equal(ns["tokens"], full["tokens"][:, positions])
    assert torch.equal(ns["labels"], full["labels"][:, positions])
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, positions.tolist())
    assert sorted(sum(everyone, [])) == list(range(16))
    chunk = 16 // (2 * ns["cp_size"])
    assert {p // chunk for p in positions.tolist()} == {ns["cp_rank"], 2 * ns["cp_size"] - 1 - ns["cp_rank"]}


def cp_attention_inputs() -> dict:
    """This rank's load-balanced shards of float64 ``q``, ``k``, ``v`` ``[2, 2, 16, 4]`` (requiring
    grad), ``positions``, ``local_sample_ids`` (two packed samples and padding), ``cp_group``."""
    import torch.distributed as dist

    from lightning_ndclip.core.context.attention import shard_sequence

    full, rank, size = _full_sequence(), dist.get_rank(), dist.get_world_size()
    ns: dict = {"cp_group": dist.new_group(), "_full": full}
    for name in ("q", "k", "v"):
        ns[name], ns["positions"] = shard_sequence(full[name], rank, size, dim=2, load_balance=True)
        ns[name].requires_grad_(True)
    ns["local_sample_ids"], _ = shard_sequence(full["sample_ids"], rank, size, dim=1, load_balance=True)
    return ns


def attention_matches_one_device(ns: dict) -> None:
    """``out`` equals the rows at ``positions`` of plain attention over the full sequence, with the
    causal and same-sample masks (padding attends to padding), float64, 1e-12."""
    full, positions = ns["_full"], ns["positions"]
    ids = full["sample_ids"]
    same = ids[:, :, None] == ids[:, None, :]
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    mask = (same & causal)[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(full["q"], full["k"], full["v"], attn_mask=mask)
    torch.testing.assert_close(ns["out"], expected[:, :, positions], rtol=1e-12, atol=1e-12)


# --- the exact token mean by hand: FSDP2 over 2 ranks --------------------------------------------


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))


def _token_batches() -> list[list[dict]]:
    """Per rank, two micro-batches of ``[2, 6]`` tokens with uneven valid labels (-100 elsewhere)."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for rank in range(2):
        mbs = []
        for m in range(2):
            tokens = torch.randint(0, 11, (2, 6), generator=g)
            labels = torch.randint(0, 11, (2, 6), generator=g)
            labels[:, 6 - (1 + 2 * rank + m) :] = -100  # 5, 4, 3, 2 valid tokens per row
            mbs.append({"tokens": tokens, "labels": labels})
        batches.append(mbs)
    return batches


def fsdp_lm_and_micro_batches() -> dict:
    """``model``: a tiny float64 LM, ``fully_shard`` over the 2 ranks; ``micro_batches``: this rank's
    two (uneven token counts); ``loss_group``; ``optimizer`` (SGD, lr 0.5); ``F``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = _TinyLM().double()
    fully_shard(model)
    return {
        "model": model, "micro_batches": _token_batches()[dist.get_rank()], "loss_group": None,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.5), "F": nn.functional,
    }


def update_matches_one_device_token_mean(ns: dict) -> None:
    """The parameters after the block's step equal one device's: the mean over every valid token of
    both ranks' micro-batches, clipped to 1.0, one SGD step; float64, 1e-12."""
    model = _TinyLM().double()
    rows = [mb for mbs in _token_batches() for mb in mbs]
    tokens, labels = torch.cat([mb["tokens"] for mb in rows]), torch.cat([mb["labels"] for mb in rows])
    _one_device_token_mean(model, tokens, labels)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    for (name, ours), (_, ref) in zip(ns["model"].named_parameters(), model.named_parameters()):
        torch.testing.assert_close(ours.full_tensor(), ref, rtol=1e-12, atol=1e-12, msg=name)


# --- the hierarchical (per-sample) mean with packing over 2 cp ranks --------------------------------


def _packed_micro_batches() -> list[dict]:
    """Two full micro-batches of packed rows ``[2, 8]``: sample ids (-1 padding), labels, losses."""
    g = torch.Generator().manual_seed(2)
    ids = [torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1], [2, 2, 2, 2, 2, 2, 3, 3]]),
           torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0], [1, 1, -1, -1, -1, -1, -1, -1]])]
    batches = []
    for sample_ids in ids:
        labels = torch.where(sample_ids >= 0, torch.randint(0, 9, sample_ids.shape, generator=g), -100)
        labels[0, 1] = -100  # a masked token inside a sample
        losses = torch.rand(sample_ids.shape, generator=g, dtype=torch.float64)
        batches.append({"sample_ids": sample_ids, "num_samples": int(sample_ids.max()) + 1, "labels": labels,
                        "losses": losses})
    return batches


def packed_cp_micro_batches() -> dict:
    """``micro_batches``: this cp rank's shards of two packed micro-batches (``sample_ids``,
    ``num_samples``, ``labels``); ``per_token_losses(mb)``: fixed per-token losses (leaves requiring
    grad); ``cp_group`` (the 2 ranks), ``dp_group`` (this rank alone: dp = 1)."""
    import torch.distributed as dist

    from lightning_ndclip.core.context.attention import shard_sequence

    rank = dist.get_rank()
    local = []
    for mb in _packed_micro_batches():
        part = {k: shard_sequence(v, rank, 2, dim=1)[0] if torch.is_tensor(v) else v for k, v in mb.items()}
        part["losses"].requires_grad_(True)
        local.append(part)
    dp_groups = [dist.new_group([r]) for r in range(2)]
    return {"micro_batches": local, "per_token_losses": lambda mb: mb["losses"], "cp_group": dist.new_group(),
            "dp_group": dp_groups[rank]}


def weights_are_the_per_sample_mean(ns: dict) -> None:
    """Each valid token's gradient is 1 / (B T_b): B = 6 samples with a valid token, T_b its
    sample's valid tokens over both cp ranks; the loss summed over ranks is the mean of per-sample means."""
    import torch.distributed as dist

    from lightning_ndclip.core.context.attention import shard_sequence

    full = _packed_micro_batches()
    means = []
    for mb in full:
        valid = mb["labels"] != -100
        for s in range(mb["num_samples"]):
            mask = valid & (mb["sample_ids"] == s)
            means.append(mb["losses"][mask].mean())
    assert len(means) == 6
    for mb, local in zip(full, ns["micro_batches"]):
        valid = mb["labels"] != -100
        weight = torch.zeros_like(mb["losses"])
        for s in range(mb["num_samples"]):
            mask = valid & (mb["sample_ids"] == s)
            weight[mask] = 1.0 / (6 * int(mask.sum()))
        expected, _ = shard_sequence(weight, dist.get_rank(), 2, dim=1)
        torch.testing.assert_close(local["losses"].grad, expected, rtol=1e-12, atol=0)
    total = torch.stack([(m["losses"].grad * m["losses"]).sum() for m in ns["micro_batches"]]).sum()
    dist.all_reduce(total)
    torch.testing.assert_close(total, torch.stack(means).mean(), rtol=1e-12, atol=0)


# --- a fused qkv projection under tensor parallel: 2 ranks -----------------------------------------


def fused_qkv_under_tp() -> dict:
    """``self.qkv``: a fused ``Linear(16, 48)`` (4 heads of 4) made ``ColwiseParallel`` over 2 tp
    ranks; ``h`` ``[2, 5, 16]``; ``b``, ``s``, ``head_dim``."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    qkv = nn.Linear(16, 48).double()
    plain = nn.Linear(16, 48).double()
    plain.load_state_dict(qkv.state_dict())
    parallelize_module(qkv, init_device_mesh("cpu", (2,)), ColwiseParallel())
    h = torch.randn(2, 5, 16, dtype=torch.float64)
    return {"self": SimpleNamespace(qkv=qkv), "h": h, "b": 2, "s": 5, "head_dim": 4, "_plain": plain}


def qkv_split_matches_one_device(ns: dict) -> None:
    """Each tp rank's q, k, v are whole heads of the plain model's (rank r: heads 2r, 2r + 1), with
    the rows of the fused weight read head-major (q, k, v of head 0, then head 1, ...)."""
    import torch.distributed as dist

    full = ns["_plain"](ns["h"]).view(2, 5, 4, 3, 4).permute(3, 0, 2, 1, 4)  # [3, b, heads, s, head_dim]
    mine = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    for i, name in enumerate("qkv"):
        torch.testing.assert_close(ns[name], full[i][:, mine], rtol=1e-12, atol=1e-12)


# --- the per-sample mean of one packed micro-batch over 2 cp ranks ----------------------------------


def packed_cp_one_micro_batch() -> dict:
    """The first packed micro-batch of ``packed_cp_micro_batches`` as this cp rank's ``ids_local``,
    ``num_samples`` and ``token_losses``; ``cp_mesh`` (the 2 ranks) and ``dp_mesh`` (this rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ndclip.core.context.attention import shard_sequence

    mb = _packed_micro_batches()[0]
    ids = torch.where(mb["labels"] != -100, mb["sample_ids"], -1)  # masked tokens as padding
    losses, _ = shard_sequence(mb["losses"], dist.get_rank(), 2, dim=1)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp"))
    return {"ids_local": shard_sequence(ids, dist.get_rank(), 2, dim=1)[0], "num_samples": mb["num_samples"],
            "token_losses": losses.requires_grad_(True), "cp_mesh": mesh["cp"], "dp_mesh": mesh["dp"], "_mb": mb}


def one_micro_batch_is_the_per_sample_mean(ns: dict) -> None:
    """Each valid token's gradient is 1 / (B T_b) (B = 4 samples, T_b over both cp ranks)."""
    import torch.distributed as dist

    from lightning_ndclip.core.context.attention import shard_sequence

    mb = ns["_mb"]
    valid = mb["labels"] != -100
    weight = torch.zeros_like(mb["losses"])
    for s in range(mb["num_samples"]):
        mask = valid & (mb["sample_ids"] == s)
        weight[mask] = 1.0 / (mb["num_samples"] * int(mask.sum()))
    expected, _ = shard_sequence(weight, dist.get_rank(), 2, dim=1)
    torch.testing.assert_close(ns["token_losses"].grad, expected, rtol=1e-12, atol=0)


# --- the Hugging Face how-to ------------------------------------------------------------------------


def tiny_llama() -> dict:
    """``llama``: a tiny transformers Llama built from a config (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return {"llama": LlamaForCausalLM(config)}


def hf_cp_inputs() -> dict:
    """A tiny float64 transformers Llama (``model``), a batch of 2 rows of 16 tokens (``batch``: ``input_ids``,
    ``labels``) and ``cp_mesh`` over the ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config).double()
    tokens = torch.randint(3, 32, (2, 16), generator=torch.Generator().manual_seed(0))
    cp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))["cp"]
    return {"model": model, "batch": {"input_ids": tokens, "labels": tokens}, "cp_mesh": cp_mesh,
            "_plain": copy.deepcopy(model)}  # fmt: skip


def hf_cp_loss_is_one_device(ns: dict) -> None:
    """The ranks' losses sum to the plain model's loss on the whole batch, and so do their gradients."""
    import torch.distributed as dist

    plain = ns["_plain"]
    expected = plain(**ns["batch"]).loss
    expected.backward()
    total = ns["loss"].detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, expected.detach(), rtol=1e-6, atol=0)  # transformers' loss is float32
    for (name, param), reference in zip(ns["model"].named_parameters(), plain.parameters()):
        grad = param.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, reference.grad, rtol=1e-6, atol=1e-9, msg=name)


# --- experts without Lightning: 4 ranks, dp_shard=4 for dense weights, edp=2 x ep=2 for experts ------


class _MoEModel(nn.Module):
    def __init__(self) -> None:
        from lightning_ndclip.core.experts import MoE

        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(13, 8)
        self.moe = MoE(8, 16, num_experts=4)
        self.head = nn.Linear(8, 13)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.moe(h))


def _moe_rows() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, 13, (8, 5), generator=g)
    labels = torch.randint(0, 13, (8, 5), generator=g)
    labels[::3, 3:] = -100
    return tokens, labels


def moe_model_and_batch() -> dict:
    """``model``: a float64 embedding, ``moe = MoE(8, 16, num_experts=4)`` and head; this rank's
    ``tokens`` / ``labels`` (2 of 8 rows); ``F``, ``shard_experts``, ``fully_shard``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from lightning_ndclip.core.experts import shard_experts

    tokens, labels = _moe_rows()
    mine = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    return {"model": _MoEModel().double(), "tokens": tokens[mine], "labels": labels[mine], "F": nn.functional,
            "shard_experts": shard_experts, "fully_shard": fully_shard}


def moe_norm_matches_one_device(ns: dict) -> None:
    """The pre-clip norm equals one device's: the same model, the token mean over all 8 rows (1e-12)."""
    _, expected = _one_device_token_mean(_MoEModel().double(), *_moe_rows())
    _assert_relative(ns["norm"], expected, 1e-12)


# --- the pure-PyTorch page's smaller blocks -------------------------------------------------------


def _ddp_rows() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, 11, (4, 6), generator=g)
    labels = torch.randint(0, 11, (4, 6), generator=g)
    labels[0, 2:] = -100  # rank 0 holds fewer valid tokens
    return tokens, labels


def ddp_model_and_batch() -> dict:
    """``model``: a float64 tiny LM (the same on both ranks); this rank's ``tokens`` / ``labels``
    (2 of 4 rows, uneven valid tokens); ``F``, ``nd``."""
    import torch.distributed as dist

    import lightning_ndclip as nd

    tokens, labels = _ddp_rows()
    mine = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    return {"model": _TinyLM().double(), "tokens": tokens[mine], "labels": labels[mine], "F": nn.functional, "nd": nd}


def ddp_norm_matches_one_device(ns: dict) -> None:
    """The pre-clip norm equals one device's token mean over the 4 rows (float64, 1e-12)."""
    _, expected = _one_device_token_mean(_TinyLM().double(), *_ddp_rows())
    _assert_relative(ns["norm"], expected, 1e-12)


def loss_sums_of_two_ranks() -> dict:
    """This rank's ``loss_sum`` and ``labels`` (rank 0: 3 valid tokens, rank 1: 5); ``loss_group``
    (the world); ``nd``."""
    import torch.distributed as dist

    import lightning_ndclip as nd

    rank = dist.get_rank()
    labels = torch.tensor([1, 2, 3, -100, -100]) if rank == 0 else torch.tensor([4, 5, 6, 7, 8])
    return {"loss_sum": torch.tensor(6.0 if rank == 0 else 20.0), "labels": labels, "loss_group": None, "nd": nd}


def metric_is_the_token_mean(ns: dict) -> None:
    """(6 + 20) / (3 + 5) on every rank, where the mean of the ranks' means would give 3.0."""
    assert float(ns["metric"].compute()) == 26.0 / 8
