"""Context parallelism for transformers models (``lightning_ndclip.integrations.transformers.context``): the batch cut along
the sequence, attention routed to ring attention, the model's own loss exact. The reference is the plain model
on one process in float64, on the whole batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_on_ranks
from hf_families import tiny_causal_lm
from torch.distributed.device_mesh import init_device_mesh

pytest.importorskip("transformers")

from lightning_ndclip import _compat  # noqa: E402
from lightning_ndclip.integrations.transformers.context import context_parallelize, shard_batch  # noqa: E402

ROWS, SEQ = 2, 16


def _batch(layout: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 32, (ROWS, SEQ), generator=g)
    labels = input_ids.clone()
    labels[0, :3] = -100  # a prompt not predicted
    batch = {"input_ids": input_ids, "labels": labels}
    if layout == "padded":  # right padding, as training collators pad, and a masked token inside row 1
        mask = torch.ones(ROWS, SEQ, dtype=torch.int64)
        mask[0, 12:] = 0
        mask[1, 4] = mask[1, 13:] = 0
        labels[mask == 0] = -100
        batch["attention_mask"] = mask
    if layout == "packed-no-cache":  # transformers looks for packed sequences only without a cache
        batch["use_cache"] = False
    if layout.startswith("packed"):  # documents of 5, 7, 4 tokens in row 0, 9 and 7 in row 1
        batch["position_ids"] = torch.cat(
            [torch.cat([torch.arange(n) for n in lengths])[None] for lengths in ([5, 7, 4], [9, 7])]
        )
    return batch


def _model(family: str, **config) -> torch.nn.Module:
    return tiny_causal_lm(family, **config).double()


def _loss(model, batch, loss: str) -> torch.Tensor:
    """The model's own ``.loss`` (transformers computes it in float32), or the float64 sum of per-token losses of
    labels shifted beforehand (``next_labels``), divided by the micro-batch's count."""
    if loss == "model":
        return model(**batch).loss
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "next_labels")}
    logits = model(**inputs).logits
    per_token = F.cross_entropy(logits.flatten(0, 1), batch["next_labels"].flatten(), reduction="none")
    return per_token.sum() / COUNT


def _with_next_labels(batch):
    labels = batch["labels"]
    return {**batch, "next_labels": torch.cat([labels[:, 1:], torch.full((ROWS, 1), -100)], dim=1)}


COUNT = 23.0  # any constant: both sides divide by it


def _one_device(model, batch, loss: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = copy.deepcopy(model)
    value = _loss(model, batch, loss)
    value.backward()
    return value.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _context_parallel(family: str, layout: str, config: dict, loss: str) -> float:
    """The worst error, relative to the largest entry, of the loss and every gradient summed over the cp ranks."""
    model = _model(family, **config)
    batch = _with_next_labels(_batch(layout))
    expected_loss, expected = _one_device(model, batch, loss)
    cp = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))["cp"]
    context_parallelize(model, cp)
    local, shard = shard_batch(batch, cp)
    with shard.active():
        value = _loss(model, local, loss)
    assert shard.model_losses == ([value] if loss == "model" else [])
    value.backward()
    total = value.detach().clone()
    dist.all_reduce(total)  # the ranks' parts of the micro-batch's token mean
    errors = [abs(total.item() - expected_loss) / abs(expected_loss)]
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad)
        reference = expected.get(name, torch.zeros_like(param))
        errors.append(float((grad - reference).abs().max() / reference.abs().max().clamp_min(1e-30)))
    return max(errors)


def _tolerance(family: str) -> float:
    """float64's; float32's for a family whose attention transformers runs eagerly (its softmax is taken in float32)
    or soft-caps (transformers 5.0 runs Gemma 2 on sdpa, which skips the cap: 1e-7 at these scores)."""
    config = tiny_causal_lm(family).config
    plain = _compat.attention_implementation(config) == "sdpa" and getattr(config, "attn_logit_softcapping", None) is None
    return 1e-10 if plain else 1e-5


@pytest.mark.parametrize("layout", ["plain", "padded", "packed", "packed-no-cache"])
@pytest.mark.parametrize("family", ["Llama", "Mistral", "Gemma2 (tied)"])
def test_per_token_losses_and_gradients_equal_one_device(family, layout):
    # Mistral: a sliding window on every layer; Gemma 2: on every other one, with soft-capping
    config = {"sliding_window": 5} if family in ("Mistral", "Gemma2 (tied)") else {}
    assert max(run_on_ranks(2, _context_parallel, family, layout, config, "per_token")) < _tolerance(family)


@pytest.mark.parametrize("family", ["Llama", "Gemma2 (tied)"])
def test_the_models_own_loss_equals_one_device(family):
    # labels shifted over the whole sequence, the micro-batch's count over both ranks; transformers computes this
    # loss in float32 (logits.float()), so float32's tolerance
    config = {"sliding_window": 5} if family.startswith("Gemma") else {}
    assert max(run_on_ranks(2, _context_parallel, family, "padded", config, "model")) < 1e-5


def _naive_cut(family: str) -> float:
    """Each rank runs the plain model on its chunks (local positions, local attention, local label shift)."""
    model = _model(family)
    batch = _with_next_labels(_batch("plain"))
    expected_loss, _ = _one_device(model, batch, "per_token")
    cp = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))["cp"]
    local, _ = shard_batch(batch, cp)
    total = _loss(model, local, "per_token").detach()
    dist.all_reduce(total)
    return abs(total.item() - expected_loss) / expected_loss


def test_the_check_fails_for_a_naive_cut():
    # what the test above would measure without context_parallelize: far from one device
    assert min(run_on_ranks(2, _naive_cut, "Llama")) > 1e-5  # the tolerance above is 1e-10


def _refusals() -> list[str]:
    cp = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))["cp"]
    messages = []
    for call in (
        lambda: context_parallelize(_model("Llama", attention_dropout=0.1), cp),
        lambda: context_parallelize(_model("Llama", attention_chunk_size=4), cp),  # Llama 4's chunked attention
        lambda: shard_batch({"input_ids": torch.zeros(2, 6, dtype=torch.int64)}, cp),
        lambda: shard_batch([torch.zeros(2, 8)], cp),  # type: ignore[arg-type]
        lambda: shard_batch({"input_ids": torch.zeros(2, 8, dtype=torch.int64), "attention_mask": torch.ones(2, 1, 8, 8)}, cp),
    ):
        with pytest.raises(ValueError) as error:
            call()
        messages.append(str(error.value))
    return messages


def test_what_cannot_be_cut_exactly_is_refused_naming_it():
    dropout, chunked, length, not_a_dict, mask = run_on_ranks(2, _refusals)[0]
    assert "config.attention_dropout is 0.1" in dropout
    assert "config.attention_chunk_size is 4" in chunked
    assert "length 6 is not a multiple of 4" in length and "pad_to_multiple_of" in length
    assert "must be a dict holding 'input_ids'" in not_a_dict and "list" in not_a_dict
    assert "2-D [rows, seq] padding mask" in mask


def _no_transformers_model() -> str:
    from lightning_ndclip.core.parallel.mesh import ParallelDims
    from lightning_ndclip.core.parallel.plan import parallelize

    meshes = ParallelDims(world_size=2, dp_shard=1, cp=2).build_mesh("cpu")
    with pytest.raises(ValueError) as error:
        parallelize(torch.nn.Linear(4, 4), meshes, tp_plan="auto")
    return str(error.value)


def test_auto_with_cp_and_no_transformers_model_is_refused():
    # the strategy would cut the batches of a model whose attention nobody routed: refused instead
    assert "holds no model of transformers" in run_on_ranks(2, _no_transformers_model)[0]


def _dynamic_rope() -> str:
    cp = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))["cp"]
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError) as error:
        context_parallelize(_model("Llama", rope_parameters=rope), cp)
    return str(error.value)


def test_a_rotary_embedding_that_depends_on_the_calls_length_is_refused():
    # dynamic NTK / longrope rescale by the largest position of the call: each cp rank would see another
    assert "rotary embedding is 'dynamic'" in run_on_ranks(2, _dynamic_rope)[0]
