"""Golden tests of the examples' models: each model, parallelized exactly as its example does it (the
example's own plan, ``configure_model`` or parallelize function, built from its command line), gives
the forward output and the gradients of one backward of the PLAIN model on one process holding the
same weights, in float64 to 1e-10.

The reference is never the same parallel recipe at size 1: a recipe that computes another function
(a fused qkv split against the tensor-parallel shards, say) would agree with itself at any size.

Each example's configurations on 4 CPU ranks (2 for the quickstart's default):

* ``train_gpt.py``: FSDP2 x TP (``dp_shard=2 x tp=2``, ``tp=4``) and pipeline x FSDP2 (``pp=2 x dp_shard=2``);
* ``train_video_dit.py``: FSDP2 x context parallel (``dp_shard=2 x cp=2``, ``cp=4``);
* ``train_moe.py``: FSDP2 x expert parallel (``dp_shard=4``, ``ep=2`` and ``ep=4``);
* ``lightning_quickstart.py``: FSDP2 (2 ranks) and FSDP2 x TP (``--devices 4 --tp 2``);
* ``norm_demo.py``: FSDP2 x TP on some layers only (``dp_shard=2 x tp=2``).

What the strategy adds to the examples' parallelization is mirrored: the declarative plan goes
through :func:`lightning_ndclip.core.parallel.plan.parallelize` (with the root unit the strategy picks,
``self.model``), the pipeline through :func:`lightning_ndclip.core.pipeline.build_pipeline` with the
same split, and ``use_sum_reduction`` where the example sets ``loss_normalization`` (each rank then
backpropagates its part of a loss whose sum over the ranks is the plain model's loss).
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_ndclip import ParallelDims, use_sum_reduction
from lightning_ndclip.core.pipeline import build_pipeline

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:  # the examples import their _common.py as a top-level module
    sys.path.insert(0, str(EXAMPLES))

import lightning_quickstart  # noqa: E402
import norm_demo  # noqa: E402
import train_gpt  # noqa: E402
import train_moe  # noqa: E402
import train_video_dit  # noqa: E402

TOLERANCE = 1e-10
"""Largest relative difference (max |parallel - plain| / max |plain|, per tensor), in float64."""

WORLD = 4
ROWS_PER_RANK = 2
"""Rows of the batch each data-parallel rank holds; the plain model gets all of them."""


# --- shared helpers (run on the ranks) --------------------------------------------------------------


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _difference(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(max abs difference, that / max |want|)``."""
    assert got.shape == want.shape, (got.shape, want.shape)
    abs_diff = float((got.detach() - want.detach()).abs().max())
    scale = float(want.detach().abs().max())
    return abs_diff, abs_diff / scale if scale > 0 else abs_diff


def _compare(
    outputs: list[tuple[torch.Tensor, torch.Tensor]], parallel: nn.Module, plain: nn.Module
) -> dict[str, tuple[float, float]]:
    """Differences of the forward outputs and of every gradient this rank's ``parallel`` holds (full
    tensors) from the ``plain`` model's, by name. Collective: every parameter of ``plain`` must have
    its gradient on some rank (a pipeline stage holds some; a copy a stage does not use has none)."""
    result = {f"output{i}": _difference(got, want) for i, (got, want) in enumerate(outputs)}
    reference = dict(plain.named_parameters())
    for name, p in parallel.named_parameters():
        want = reference[name].grad
        assert want is not None, name
        if p.grad is not None:
            result[f"grad {name}"] = _difference(_full(p.grad), want)
    compared: list[set[str]] = [set() for _ in range(dist.get_world_size())]
    dist.all_gather_object(compared, {name.removeprefix("grad ") for name in result if name.startswith("grad ")})
    missing = set(reference) - set.union(*compared)
    assert not missing, f"no rank holds the gradient of {sorted(missing)}"
    return result


def _worst(results: list[dict[str, tuple[float, float]]], kind: str) -> tuple[float, float, str]:
    """The largest ``(abs, rel)`` difference over the ranks among the ``kind`` ("output" / "grad") entries."""
    entries = [(rel, abs_, name) for r in results for name, (abs_, rel) in r.items() if name.startswith(kind)]
    rel, abs_, name = max(entries)
    return abs_, rel, name


def _assert_golden(results: list[dict[str, tuple[float, float]]]) -> None:
    worst = {kind: _worst(results, kind) for kind in ("output", "grad")}
    report = "; ".join(f"worst {kind}: {name}: max abs {a:.3e}, rel {r:.3e}" for kind, (a, r, name) in worst.items())
    assert all(math.isfinite(r) and r <= TOLERANCE for _, r, _ in worst.values()), (
        f"the parallel model differs from the plain model (tolerance {TOLERANCE:.0e}): {report}"
    )


def _randomize_zeros(model: nn.Module, seed: int = 1) -> None:
    """Give zero-initialized weights (adaLN-Zero modulations) random values: at zero a block is the
    identity, and its attention would not reach the output the test compares."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)


# --- train_gpt.py: FSDP2 x TP, pipeline x FSDP2 -----------------------------------------------------

_GPT_SIZE = ["--vocab", "32", "--width", "32", "--heads", "4", "--layers", "2", "--seq-len", "16", "--rows", "16"]


def _gpt_setup(argv: list[str]):
    args = train_gpt.parse_args(["--devices", str(WORLD), *_GPT_SIZE, *argv])
    kwargs = train_gpt.strategy_kwargs(args)
    dims = ParallelDims(world_size=WORLD, dp_shard=kwargs["dp_shard"], tp=kwargs["tp"], pp=kwargs["pp"])
    torch.manual_seed(0)
    lit = train_gpt.LitGPT(args).double()
    plain = copy.deepcopy(lit.model)
    tokens, labels = train_gpt.packed_documents(args.rows, args.seq_len, args.vocab).tensors
    rows = ROWS_PER_RANK * dims.batch_size
    return args, kwargs, dims, lit, plain, tokens[:rows], labels[:rows]


def _gpt_plain(plain: nn.Module, lit, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The plain model on the whole batch: logits, and the backward of the loss sum."""
    logits = plain(tokens)
    lit.pipeline_loss(logits, labels).sum().backward()
    return logits


def _gpt_fsdp_tp(argv: list[str]) -> dict[str, tuple[float, float]]:
    args, kwargs, dims, lit, plain, tokens, labels = _gpt_setup(argv)
    meshes = dims.build_mesh("cpu")
    # as NDParallelStrategy applies its declarative plan: the root unit is what training_step calls
    kwargs["plan"].apply(lit, meshes, root_units=[lit.model])
    use_sum_reduction(lit)  # loss_normalization="token_mean"
    mine = slice(meshes["dp"].get_local_rank() * ROWS_PER_RANK, (meshes["dp"].get_local_rank() + 1) * ROWS_PER_RANK)
    logits = lit.model(tokens[mine])
    lit.pipeline_loss(logits, labels[mine]).sum().backward()  # this rank's loss sum: summed over dp, the batch's
    want = _gpt_plain(plain, lit, tokens, labels)
    return _compare([(logits, want[mine])], lit.model, plain)


def _gpt_pipeline(argv: list[str]) -> dict[str, tuple[float, float]]:
    args, kwargs, dims, lit, plain, tokens, labels = _gpt_setup(argv)
    meshes = dims.build_mesh("cpu")
    options = kwargs["pipeline"]

    def parallelize_stage(stage: nn.Module) -> None:  # as the strategy's PipelineRunner does
        kwargs["plan"].apply(stage, meshes)
        use_sum_reduction(stage)

    schedule, stages = build_pipeline(
        lit.model, meshes["pp"], options.split_points, n_microbatches=options.microbatches,
        loss_fn=lambda out, target: lit.pipeline_loss(out, target).sum(), parallelize_fn=parallelize_stage,
        device=torch.device("cpu"),
    )  # fmt: skip
    (stage,) = stages
    outputs: list[torch.Tensor] = []  # the stage's outputs; the last n_microbatches are the step's
    stage.register_forward_hook(lambda module, inputs, output: outputs.append(output.detach()))
    dp = meshes["dp"].get_local_rank()
    mine = slice(dp * ROWS_PER_RANK, (dp + 1) * ROWS_PER_RANK)
    pp_rank, pp = meshes["pp"].get_local_rank(), meshes["pp"].size()
    if pp_rank == 0:
        schedule.step(tokens[mine])
    elif pp_rank == pp - 1:
        schedule.step(target=labels[mine])
    else:
        schedule.step()
    want = _gpt_plain(plain, lit, tokens, labels)
    n = options.microbatches  # (a first forward before them infers the stage's shapes)
    if pp_rank == pp - 1:
        compared = [(torch.cat(outputs[-n:]), want[mine])]
    else:  # a hidden state between stages: the plain model's, up to the split
        split = int(options.split_points[pp_rank].split(".")[1])
        h = plain.embed(tokens[mine]) + plain.pos[: tokens.shape[1]]
        for i in range(split):
            h = plain.layers[str(i)](h)
        compared = [(torch.cat(outputs[-n:]), h)]
    return _compare(compared, stage, plain)


@pytest.mark.parametrize(
    "argv",
    [pytest.param([], id="default-dp_shard2xtp2"), pytest.param(["--dp-shard", "1", "--tp", "4"], id="tp4")],
)
def test_train_gpt_fsdp_x_tp_computes_the_plain_model(argv):
    _assert_golden(run_on_ranks(WORLD, _gpt_fsdp_tp, argv))


def test_train_gpt_refuses_heads_that_tp_cannot_split_whole():
    with pytest.raises(ValueError, match="--heads 6 must be divisible by --tp 4"):
        train_gpt.strategy_kwargs(train_gpt.parse_args(["--heads", "6", "--tp", "4"]))


def test_train_gpt_pipeline_x_fsdp_computes_the_plain_model():
    _assert_golden(run_on_ranks(WORLD, _gpt_pipeline, ["--tp", "1", "--pp", "2", "--dp-shard", "2"]))


# --- train_video_dit.py: FSDP2 x context parallel ---------------------------------------------------

_DIT_SIZE = ["--grid", "4", "--patch", "2", "--channels", "2", "--max-frames", "3", "--width", "32", "--heads", "4",
             "--layers", "2", "--seq-len", "16", "--rows", "16"]


def _dit(argv: list[str]) -> dict[str, tuple[float, float]]:
    args = train_video_dit.parse_args(["--devices", str(WORLD), *_DIT_SIZE, *argv])
    kwargs = train_video_dit.strategy_kwargs(args)
    dims = ParallelDims(world_size=WORLD, dp_shard=kwargs["dp_shard"], cp=kwargs["cp"])
    torch.manual_seed(0)
    lit = train_video_dit.LitVideoDiT(args)
    _randomize_zeros(lit)
    lit.double()
    plain = copy.deepcopy(lit.model)
    rows = ROWS_PER_RANK * dims.batch_size
    batch = [t[:rows] for t in train_video_dit.packed_video_latents(args).tensors]
    batch = [t.double() if t.is_floating_point() else t for t in batch]
    weights = torch.rand(rows, args.seq_len, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    meshes = dims.build_mesh("cpu")
    kwargs["plan"].apply(lit, meshes, root_units=[lit.model])
    use_sum_reduction(lit)  # loss_normalization="sample_mean"
    dp = meshes["dp"].get_local_rank()
    mine = slice(dp * ROWS_PER_RANK, (dp + 1) * ROWS_PER_RANK)
    cp = meshes["cp"]
    rank, size = cp.get_local_rank(), cp.size()
    prediction, target = train_video_dit.cp_forward(lit.model, [t[mine] for t in batch], rank, size, cp.get_group())
    local_weights = train_video_dit.shard_sequence(weights[mine], rank, size)[0]
    # per-token losses as the example's training_step, weighted (the strategy weighs them too)
    (F.mse_loss(prediction, target, reduction="none").mean(-1) * local_weights).sum().backward()

    want, target = train_video_dit.cp_forward(plain, batch, 0, 1, None)  # one device: no cp group
    (F.mse_loss(want, target, reduction="none").mean(-1) * weights).sum().backward()
    want_mine = train_video_dit.shard_sequence(want[mine], rank, size)[0]
    return _compare([(prediction, want_mine)], lit.model, plain)


@pytest.mark.parametrize(
    "argv",
    [pytest.param([], id="default-dp_shard2xcp2"), pytest.param(["--dp-shard", "1", "--cp", "4"], id="cp4")],
)
def test_train_video_dit_fsdp_x_cp_computes_the_plain_model(argv):
    _assert_golden(run_on_ranks(WORLD, _dit, argv))


# --- train_moe.py: FSDP2 x expert parallel ----------------------------------------------------------

_MOE_SIZE = ["--vocab", "32", "--width", "16", "--heads", "2", "--layers", "2", "--experts", "4", "--seq-len", "16",
             "--rows", "16"]


def _moe(argv: list[str]) -> dict[str, tuple[float, float]]:
    args = train_moe.parse_args(["--devices", str(WORLD), *_MOE_SIZE, *argv])
    kwargs = train_moe.strategy_kwargs(args)
    dims = ParallelDims(world_size=WORLD, dp_shard=kwargs["dp_shard"], ep=kwargs["ep"])
    torch.manual_seed(0)
    lit = train_moe.LitMoE(args).double()
    plain = copy.deepcopy(lit.model)
    rows = ROWS_PER_RANK * dims.batch_size
    tokens, labels = (t[:rows] for t in train_moe.topic_documents(args.rows, args.seq_len, args.vocab, args.topics).tensors)

    meshes = dims.build_mesh("cpu")
    train_moe.parallelize_moe(lit.model, meshes)  # what LitMoE.configure_model does
    use_sum_reduction(lit)  # loss_normalization="token_mean"
    dp = meshes["dp"].get_local_rank()
    mine = slice(dp * ROWS_PER_RANK, (dp + 1) * ROWS_PER_RANK)
    logits = lit.model(tokens[mine])
    F.cross_entropy(logits.flatten(0, 1), labels[mine].flatten(), ignore_index=-100, reduction="sum").backward()

    want = plain(tokens)
    F.cross_entropy(want.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum").backward()
    return _compare([(logits, want[mine])], lit.model, plain)


@pytest.mark.parametrize(
    "argv", [pytest.param([], id="default-dp_shard4-ep2"), pytest.param(["--ep", "4"], id="ep4")]
)
def test_train_moe_fsdp_x_ep_computes_the_plain_model(argv):
    _assert_golden(run_on_ranks(WORLD, _moe, argv))


# --- lightning_quickstart.py: FSDP2, FSDP2 x TP -----------------------------------------------------


def _quickstart(argv: list[str]) -> dict[str, tuple[float, float]]:
    args = lightning_quickstart.parse_args(argv)
    kwargs = lightning_quickstart.strategy_kwargs(args)
    dims = ParallelDims(world_size=dist.get_world_size(), tp=kwargs["tp"])
    torch.manual_seed(0)
    lit = lightning_quickstart.Regressor().double()
    plain = copy.deepcopy(lit.net)
    x, y = (t[: 8 * dims.batch_size].double() for t in lit.train_dataloader().dataset.tensors)

    meshes = dims.build_mesh("cpu")
    kwargs["plan"].apply(lit, meshes, root_units=[lit.net])
    dp = meshes["dp"].get_local_rank()
    mine = slice(dp * 8, (dp + 1) * 8)
    out = lit.net(x[mine])
    # the example's per-rank mean, no loss_normalization: FSDP2 averages over the (equal-sized) ranks
    F.mse_loss(out, y[mine]).backward()
    want = plain(x)
    F.mse_loss(want, y).backward()
    return _compare([(out, want[mine])], lit.net, plain)


@pytest.mark.parametrize(
    ("world", "argv"),
    [pytest.param(2, [], id="default-fsdp2"), pytest.param(4, ["--devices", "4", "--tp", "2"], id="fsdp2xtp2")],
)
def test_lightning_quickstart_computes_the_plain_model(world, argv):
    _assert_golden(run_on_ranks(world, _quickstart, argv))


# --- norm_demo.py: FSDP2 x TP on some layers ----------------------------------------------------------


def _norm_demo(dp: int, tp: int) -> dict[str, tuple[float, float]]:
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))  # as the demo's worker
    plain = norm_demo.build_model()
    model = norm_demo.parallelize(norm_demo.build_model(), mesh)
    data = norm_demo.batches(dp)
    x, y = data[mesh["dp_shard"].get_local_rank()]
    out = model(x)
    F.mse_loss(out, y).backward()  # per-rank mean; FSDP2 averages over dp_shard
    x_all, y_all = (torch.cat(t) for t in zip(*data))
    want = plain(x_all)
    F.mse_loss(want, y_all).backward()  # equal-sized batches: the mean of the ranks' means
    rows = slice(mesh["dp_shard"].get_local_rank() * len(x), (mesh["dp_shard"].get_local_rank() + 1) * len(x))
    return _compare([(out, want[rows])], model, plain)


def test_norm_demo_model_computes_the_plain_model():
    _assert_golden(run_on_ranks(WORLD, _norm_demo, 2, 2))
