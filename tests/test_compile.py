"""``torch.compile`` per transformer block, the torchtitan way, on the package's parallelization: no graph break.

Every hook and style the package puts inside a block traces under ``fullgraph=True``: the tensor-parallel
layers' output hook (``output_not_a_view``), ``SequenceParallel`` on split heads, ``LatentKeyParallel``, FSDP2
units, activation checkpointing, through ``tensor_parallelize``, the declarative plan
(``parallelize(..., compile=...)``, ``ParallelPlan(compile=...)``) and ``tp_plan="auto"``. Each case counts
Dynamo's graph breaks (none) and graphs (some: the blocks did compile), on the ``aot_eager`` backend, and
compares the compiled step's loss and gradients with the same layout uncompiled, in float64. The first forward
of a strategy runs under the split-activation watch: compiled blocks run eagerly there and compile in the next.
The old hook (``operator.attrgetter("_base")``) is shown breaking every tensor-parallel layer's graph.
"""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import run_on_ranks
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

import lightning_ndclip as nd
from lightning_ndclip import _compat
from lightning_ndclip.core.parallel.plan import parallelize
from lightning_ndclip.core.parallel.split_activations import watch_split_activations
from lightning_ndclip.core.parallel.tensor_parallel import matches_plan_key, output_not_a_view
from lightning_ndclip.integrations.transformers.plans import LatentKeyParallel

WIDTH, HEAD, ROPE = 8, 2, 2
BACKEND = {"backend": "aot_eager"}


class Block(nn.Module):
    """Attention-shaped without the sequence mix: q (colwise) with a per-head norm (``SequenceParallel`` on the
    split heads), a latent key projection kept whole whose rotary part meets the split heads
    (``LatentKeyParallel``), and an output projection (rowwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.q = nn.Linear(WIDTH, WIDTH)
        self.q_norm = nn.LayerNorm(HEAD)
        self.latent = nn.Linear(WIDTH, WIDTH + ROPE)
        self.kv_b = nn.Linear(WIDTH, WIDTH)
        self.o = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm(x)
        q = self.q_norm(self.q(h).view(b, s, -1, HEAD))  # this rank's heads
        latent, rotary = self.latent(h).split([WIDTH, ROPE], dim=-1)
        k = self.kv_b(latent).view(b, s, -1, HEAD) + rotary.unsqueeze(-2)  # the rotary part shared by all heads
        return x + self.o((torch.sigmoid((q * k).sum(-1, keepdim=True)) * k).flatten(-2))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


TP_PLAN = {
    "blocks.*.q": ColwiseParallel(),
    "blocks.*.q_norm": SequenceParallel(sequence_dim=-2, use_local_output=True),
    "blocks.*.latent": LatentKeyParallel(rope_dim=ROPE),
    "blocks.*.kv_b": ColwiseParallel(),
    "blocks.*.o": RowwiseParallel(),
}


def _net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, 3, generator=g, dtype=torch.float64), torch.randint(0, 5, (2, 3), generator=g)


def _step(model: nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward on the fixed batch: the loss and every gradient, whole."""
    x, y = _batch()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", "")] = grad.detach().clone()
        p.grad = None
    return loss.item(), grads


def _counts() -> dict[str, Any]:
    counters = _compat.dynamo_counters()
    return {"breaks": dict(counters["graph_break"]), "graphs": counters["stats"]["unique_graphs"]}


def _compiled_steps(model: nn.Module, tp_mesh: Any) -> tuple[float, dict[str, torch.Tensor], dict[str, Any]]:
    """The first step as the strategy runs it (under the split-activation watch), then a second one, compiled:
    its loss, gradients and Dynamo's counts."""
    torch.compiler.reset()
    _compat.dynamo_counters().clear()
    with watch_split_activations(model, tp_mesh):
        first = model(_batch()[0])
    graphs_in_first = _counts()["graphs"]
    first.sum().backward()
    for p in model.parameters():
        p.grad = None
    loss, grads = _step(model)
    return loss, grads, {**_counts(), "graphs_in_first": graphs_in_first}


def _same(a: tuple[float, dict[str, torch.Tensor]], b: tuple[float, dict[str, torch.Tensor]]) -> bool:
    return (
        abs(a[0] - b[0]) < 1e-12
        and a[1].keys() == b[1].keys()
        and all(torch.allclose(a[1][n], b[1][n], rtol=0, atol=1e-12) for n in a[1])
    )


_OLD_VIEW_BASE = operator.attrgetter("_base")


def _old_output_not_a_view(module: nn.Module, inputs: Any, output: Any) -> Any:
    """The hook as it was: Dynamo cannot call the C-level ``attrgetter`` (made once, as ``_compat.view_base``)."""
    if type(output) is torch.Tensor and _OLD_VIEW_BASE(output) is not None:
        return _compat.unsafe_view(output, output.shape)
    return output


def _breaks_of_one_layer(hook: Any, tp_mesh: Any) -> dict[str, int]:
    """The graph breaks of a compiled colwise layer that has ``hook`` (besides ``tensor_parallelize``'s own)."""
    torch.compiler.reset()
    _compat.dynamo_counters().clear()
    torch.manual_seed(0)
    layer = nd.tensor_parallelize(nn.Sequential(nn.Linear(4, 4)), tp_mesh, {"0": ColwiseParallel()})
    layer[0].register_forward_hook(hook)
    torch.compile(layer, **BACKEND)(torch.randn(2, 3, 4)).sum().backward()
    return _counts()["breaks"]


def _plan_case() -> dict[str, Any]:
    meshes = nd.ParallelDims(world_size=2, tp=2).build_mesh("cpu")
    plan = {"tp_plan": TP_PLAN, "fsdp_units": [Block], "activation_checkpointing": [Block]}
    expected = _step(parallelize(_net(), meshes, **plan))
    loss, grads, counts = _compiled_steps(parallelize(_net(), meshes, **plan, compile=BACKEND), meshes["tp"])
    return {"exact": _same((loss, grads), expected), "counts": counts}


def test_the_declarative_plan_compiles_its_blocks_with_no_graph_break_and_exact():
    """``parallelize(..., compile=...)`` (``ParallelPlan(compile=...)``): the tp plan with the package's styles,
    activation checkpointing and FSDP2 units, each block compiled with ``fullgraph=True``; the first forward under
    the split-activation watch runs eagerly."""
    for result in run_on_ranks(2, _plan_case, retire_pool=True):
        assert result["counts"]["breaks"] == {}
        assert result["counts"]["graphs"] >= 1 and result["counts"]["graphs_in_first"] == 0
        assert result["exact"]


def _tensor_parallelize_case() -> dict[str, Any]:
    meshes = nd.ParallelDims(world_size=2, tp=2).build_mesh("cpu")
    expected = _step(nd.tensor_parallelize(_net(), meshes["tp"], TP_PLAN))
    model = _net()
    model.blocks = nn.ModuleList(torch.compile(block, fullgraph=True, **BACKEND) for block in model.blocks)
    nd.tensor_parallelize(model, meshes["tp"], TP_PLAN)  # keys without the wrappers' _orig_mod
    loss, grads, counts = _compiled_steps(model, meshes["tp"])
    return {
        "exact": _same((loss, grads), expected),
        "counts": counts,
        "old_hook_breaks": _breaks_of_one_layer(_old_output_not_a_view, meshes["tp"]),
        "new_hook_breaks": _breaks_of_one_layer(output_not_a_view, meshes["tp"]),
    }


def test_tensor_parallelize_on_blocks_compiled_first_has_no_graph_break_and_is_exact():
    """``torch.compile(block, fullgraph=True)`` before ``tensor_parallelize``: the plan's keys reach the layers inside
    the wrappers (``blocks.0._orig_mod.q``), and the compiled step equals the uncompiled one. The old view hook broke
    the graph at every tensor-parallel layer."""
    for result in run_on_ranks(2, _tensor_parallelize_case, retire_pool=True):
        assert result["counts"]["breaks"] == {}
        assert result["counts"]["graphs"] >= 1 and result["counts"]["graphs_in_first"] == 0
        assert result["exact"]
        assert result["new_hook_breaks"] == {}
        assert sum(result["old_hook_breaks"].values()) > 0 and "attrgetter" in str(result["old_hook_breaks"])


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()


def _llama_step(model: nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(2))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        p.grad = None
    return loss.item(), grads


def _llama_case() -> dict[str, Any]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    meshes = nd.ParallelDims(world_size=2, tp=2).build_mesh("cpu")
    plan = {"tp_plan": "auto", "fsdp_units": [LlamaDecoderLayer]}
    expected = _llama_step(parallelize(_llama(), meshes, **plan))
    model = parallelize(_llama(), meshes, **plan, compile=BACKEND)
    torch.compiler.reset()
    _compat.dynamo_counters().clear()
    with watch_split_activations(model, meshes["tp"]):  # the strategy's first forward: eager
        _llama_step(model)
    loss, grads = _llama_step(model)
    return {"exact": _same((loss, grads), expected), "counts": _counts()}


def test_tp_plan_auto_on_a_transformers_llama_compiles_with_no_graph_break_and_exact():
    pytest.importorskip("transformers")
    for result in run_on_ranks(2, _llama_case, retire_pool=True):
        assert result["counts"]["breaks"] == {}
        assert result["counts"]["graphs"] >= 1
        assert result["exact"]


def _refusal_case(what: str) -> str:
    model = _net()
    with pytest.raises(ValueError) as error:
        if what in ("ep", "cp"):  # one graph per block where the block exchanges tokens outside Dynamo's reach
            meshes = nd.ParallelDims(world_size=2, **{what: 2}).build_mesh("cpu")  # type: ignore[arg-type]
            nd.ParallelPlan(tp_plan="auto", fsdp_units=[Block], compile=True).apply(model, meshes)
        else:  # blocks compiled before the plan
            model.blocks = nn.ModuleList(torch.compile(block, **BACKEND) for block in model.blocks)
            meshes = nd.ParallelDims(world_size=2, dp_shard=2).build_mesh("cpu")
            kwargs: dict[str, Any] = {what: [Block] if what == "activation_checkpointing" else True}
            parallelize(model, meshes, fsdp_units=[Block], **kwargs)
    return str(error.value)


def test_a_block_compiled_before_the_plan_is_refused_for_checkpointing_and_compile_naming_it():
    for what in ("activation_checkpointing", "compile"):
        message = run_on_ranks(2, _refusal_case, what)[0]
        assert f"{what}: blocks.0._orig_mod (Block) was compiled before the plan" in message
        assert "ParallelPlan(compile=True)" in message


def test_one_graph_per_block_is_refused_with_expert_or_ring_context_parallel_exchanges():
    assert "compile={'fullgraph': False}" in run_on_ranks(2, _refusal_case, "ep")[0]
    assert "kv_exchange='all_gather'" in run_on_ranks(2, _refusal_case, "cp")[0]


def test_compile_needs_fsdp_units():
    with pytest.raises(ValueError, match="name the block class in fsdp_units"):
        parallelize(_net(), None, compile=True)  # type: ignore[arg-type]  # refused before the meshes are read


def test_plan_keys_match_through_compiled_wrappers():
    assert matches_plan_key("blocks.0._orig_mod.up", "blocks.*.up")
    assert matches_plan_key("blocks.0._orig_mod.up", "blocks.*._orig_mod.up")
    assert matches_plan_key("_orig_mod.blocks.0._orig_mod.up", "blocks.*.up")
    assert not matches_plan_key("blocks.0._orig_mod.up", "blocks.*.down")
    assert not matches_plan_key("blocks.0._orig_mod", "blocks.*.up")
