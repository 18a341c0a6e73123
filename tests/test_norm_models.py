"""Golden tests of norm and clip on real ``fully_shard`` / ``parallelize_module`` models and on
pipeline stages, against the same model trained on one device in float64."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from test_norm_dtensor import assert_close, reference_norm
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import lightning_ndclip as nd
from lightning_ndclip.core.norm._runs import RunFinder, dim0_paddings

GLOBAL_BATCH = 8


def _mlp(dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 5), nn.LayerNorm(5)
    ).to(dtype)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH, 16, generator=g, dtype=torch.float64), torch.randn(
        GLOBAL_BATCH, 5, generator=g, dtype=torch.float64
    )


def _reference_grads(model: nn.Module, dp: int) -> dict[str, torch.Tensor]:
    """Single-device gradients of the mean over dp shards of the per-shard mean loss (what FSDP's
    default averaging reduction computes)."""
    x, y = _batch()
    losses = [nn.functional.mse_loss(model(xs), ys) for xs, ys in zip(x.chunk(dp), y.chunk(dp))]
    (sum(losses) / dp).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _parallel_model(dp_replicate: int, dp_shard: int, tp: int, dtype: torch.dtype = torch.float64) -> tuple[nn.Module, int]:
    mesh = init_device_mesh(
        "cpu", (dp_replicate, dp_shard, tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
    )
    model = _mlp(dtype)
    if tp > 1:  # TP on the first two linears only: the last layers live on the dp mesh alone
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dp_replicate > 1 else mesh["dp_shard"]
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    dp_rank = mesh["dp_replicate"].get_local_rank() * dp_shard + mesh["dp_shard"].get_local_rank()
    return model, dp_rank


def _model_case(dp_replicate: int, dp_shard: int, tp: int):
    dp = dp_replicate * dp_shard
    reference = _reference_grads(_mlp(), dp)
    model, dp_rank = _parallel_model(dp_replicate, dp_shard, tp)
    x, y = _batch()
    nn.functional.mse_loss(model(x.chunk(dp)[dp_rank]), y.chunk(dp)[dp_rank]).backward()

    result = {"strided": any(isinstance(pl, _StridedShard) for p in model.parameters() for pl in p.placements)}
    for p in (2.0, 1.0, 3.0, math.inf):
        norms = nd.grad_norms(model, p)
        assert_close(norms.total, reference_norm(list(reference.values()), p))
        per = norms.as_dict()
        assert set(per) == set(reference)
        for name, g in reference.items():
            assert_close(per[name], torch.linalg.vector_norm(g, p))

    nd.get_total_norm([p.grad for p in model.parameters()])  # first call with this layout: the plan
    with CommDebugMode() as comm:
        nd.get_total_norm([p.grad for p in model.parameters()])
    result["collectives"] = comm.get_total_counts()
    locals_ = [p.grad.to_local() for p in model.parameters()]
    result["runs"] = len(RunFinder().runs(locals_, [True] * len(locals_)).to_scale)
    result["tensors"] = len(locals_)
    # the whole model clipped in one call, TP on some layers only included: exact against one device
    ref_norm = reference_norm(list(reference.values()), 2.0)
    max_norm = 0.25 * float(ref_norm)
    assert_close(nd.clip_grad_norm_(model.parameters(), max_norm), ref_norm)
    coef = max_norm / (float(ref_norm) + 1e-6)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad.full_tensor(), reference[name] * coef, rtol=1e-12, atol=0), name
    return result


@pytest.mark.parametrize(
    "dp_replicate,dp_shard,tp",
    [(1, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2)],
    ids=["single", "fsdp2", "hsdp2x2", "fsdp2xtp2", "hsdp2x2xtp2"],
)
def test_real_fsdp_tp_models_match_single_device(dp_replicate, dp_shard, tp):
    world = dp_replicate * dp_shard * tp
    results = run_on_ranks(world, _model_case, dp_replicate, dp_shard, tp)
    r = results[0]
    assert all(x["collectives"] == r["collectives"] for x in results)
    assert r["collectives"] == (0 if world == 1 else 1)
    if tp > 1:
        assert r["strided"], "FSDP x TP should have produced _StridedShard placements"
    if dp_shard > 1:  # FSDP2 gradients are views of one buffer per unit: few runs, not one per tensor
        assert max(x["runs"] for x in results) < r["tensors"]


def _clip_case(scale: float):
    reference = _reference_grads(_mlp(), 2)
    ref_norm = reference_norm(list(reference.values()), 2.0)
    model, dp_rank = _parallel_model(1, 2, 2)
    x, y = _batch()
    nn.functional.mse_loss(model(x.chunk(2)[dp_rank]), y.chunk(2)[dp_rank]).backward()
    before = [p.grad.to_local().clone() for p in model.parameters()]
    max_norm = float(ref_norm) * scale
    total = nd.clip_grad_norm_(model.parameters(), max_norm)
    assert_close(total, ref_norm)
    after = nd.get_total_norm([p.grad for p in model.parameters()])
    if scale >= 1:
        assert all(torch.equal(b, p.grad.to_local()) for b, p in zip(before, model.parameters()))
        return float(after)
    coef = max_norm / (float(ref_norm) + 1e-6)
    assert_close(after, torch.tensor(max_norm * float(ref_norm) / (float(ref_norm) + 1e-6), dtype=torch.float64))
    for name, p in model.named_parameters():
        full = p.grad.full_tensor()
        assert torch.allclose(full, reference[name] * coef, rtol=1e-12, atol=0), name
    return float(after)


def test_clip_scales_to_max_norm_exactly():
    run_on_ranks(4, _clip_case, 0.25)


def test_no_clip_leaves_gradients_bit_for_bit():
    run_on_ranks(4, _clip_case, 2.0)


def _uneven_fsdp_case(exclude: str | None):
    """dp_shard=4 over layers of 5 rows: FSDP pads rank 2's one-row chunks, rank 3 holds none.
    Clips every gradient but ``exclude``'s; returns this rank's (runs to scale, runs to norm)."""
    plans = nd.NormPlans()

    def model_fn() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 5)).double()

    reference = _reference_grads(model_fn(), 4)
    model = model_fn()
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    fully_shard(model, mesh=mesh)  # one unit: every gradient is a view of one buffer
    x, y = _batch()
    rank = mesh.get_local_rank()
    nn.functional.mse_loss(model(x.chunk(4)[rank]), y.chunk(4)[rank]).backward()
    before = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    clipped = [(n, p) for n, p in model.named_parameters() if n != exclude]
    ref_norm = reference_norm([reference[n] for n, _ in clipped], 2.0)
    norms = nd.grad_norms(clipped, per_tensor=False, plans=plans)
    assert_close(norms.total, ref_norm)
    max_norm = 0.25 * float(ref_norm)
    norms.clip_(max_norm)
    coef = max_norm / (float(ref_norm) + 1e-6)
    for name, p in model.named_parameters():
        if name == exclude:
            assert torch.equal(p.grad.to_local(), before[name]), f"{name} was not clipped but changed"
        assert torch.allclose(p.grad.full_tensor(), reference[name] * (1.0 if name == exclude else coef), rtol=1e-12)
    locals_ = [p.grad.to_local() for _, p in clipped]
    padding = dim0_paddings([p.grad for _, p in clipped])
    return len(norms._to_scale), len(RunFinder().runs(locals_, [True] * len(locals_), None).to_norm), padding[0]


def test_fsdp_padding_joins_scale_runs_and_other_gaps_are_left_alone():
    runs = run_on_ranks(4, _uneven_fsdp_case, None)
    # rank 2 holds 1 of the 2 padded rows of every tensor: one scale run over the padded buffer,
    # six norm runs (one per tensor); its first weight is followed by one padding row of 16
    assert runs[2] == (1, 6, 16)
    assert [r[:2] for r in runs[:2]] == [(1, 1), (1, 1)] and runs[3][:2] == (0, 0)
    # an unclipped gradient between two clipped ones is a gap larger than the padding: not written
    runs = run_on_ranks(4, _uneven_fsdp_case, "0.bias")
    assert runs[2][0] == 2


def _copy_case(value: float, dtype: torch.dtype) -> tuple[float, float]:
    """FSDP2 x TP: the last linear and the LayerNorm live on the dp mesh only, so on tp rank 1 their
    gradients (views of their units' buffers) are copies that rank holds but does not count. Their
    local pieces are set to ``value``: on tp rank 1 only when it is not finite (a copy gone bad),
    on every rank otherwise (copies stay equal). Returns (ndclip's norm, the float64 reference)."""
    model, dp_rank = _parallel_model(1, 2, 2, dtype)
    x, y = (t.to(dtype) for t in _batch())
    nn.functional.mse_loss(model(x.chunk(2)[dp_rank]), y.chunk(2)[dp_rank]).backward()
    nd.get_total_norm([p.grad for p in model.parameters()])  # the plan, cached
    if math.isfinite(value) or dist.get_rank() % 2 == 1:
        for p in [*model[4].parameters(), *model[5].parameters()]:
            p.grad.to_local().fill_(value)
    reference = torch.stack([p.grad.full_tensor().double().square().sum() for p in model.parameters()]).sum().sqrt()
    return float(nd.get_total_norm([p.grad for p in model.parameters()])), float(reference)


@pytest.mark.faults
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_bad_copy_inside_an_fsdp_buffer_makes_the_norm_nonfinite_everywhere(bad):
    for norm, _ in run_on_ranks(4, _copy_case, bad, torch.float64):
        assert not math.isfinite(norm)


def test_copies_whose_float32_check_overflows_still_give_the_exact_norm():
    """1e36 in float32 copies: the sum of their magnitudes overflows float32 (the copies' check says
    non-finite), and so do the squares of the counted ones; the float64 retry gives the exact norm."""
    for norm, reference in run_on_ranks(4, _copy_case, 1e36, torch.float32):
        assert math.isfinite(norm) and abs(norm - reference) <= 1e-6 * reference


class _TiedLM(nn.Module):
    """Embedding -> two blocks -> output projection tied to the embedding (stage 0 | stage 1)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 8)
        self.block0 = nn.Linear(8, 8)
        self.block1 = nn.Linear(8, 8)
        self.to(torch.float64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.block1(torch.tanh(self.block0(self.embed(tokens)))))
        return h @ self.embed.weight.T


def _pipeline_case():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    reference = _TiedLM()
    tokens = torch.arange(12).remainder(11).reshape(3, 4)
    nn.functional.cross_entropy(reference(tokens).flatten(0, 1), tokens.flatten()).backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    stage = mesh["pp"].get_local_rank()
    model = copy.deepcopy(reference)
    keep = {"embed", "block0"} if stage == 0 else {"embed", "block1"}  # both stages hold the tie
    for name in list(model._modules):
        if name not in keep:
            delattr(model, name)
    for name in keep:
        fully_shard(getattr(model, name), mesh=mesh["dp_shard"])
    for name, p in model.named_parameters():  # gradients as a schedule would leave them
        p.grad = distribute_tensor(ref_grads[name], p.device_mesh, p.placements)
    tied = {"embed.weight": model.embed.weight}

    norms = nd.grad_norms(model, tied_parameters=tied)
    assert_close(norms.total, reference_norm(list(ref_grads.values()), 2.0))
    assert sorted(norms.names) == sorted(ref_grads)
    for name, value in norms.as_dict().items():
        assert_close(value, torch.linalg.vector_norm(ref_grads[name]))
    untied = nd.get_total_norm([p.grad for p in model.parameters()])
    return float(norms.total), float(untied)


def test_pipeline_stages_sum_and_tied_parameters_count_once():
    results = run_on_ranks(4, _pipeline_case)
    assert len({r[0] for r in results}) == 1
    tied, untied = results[0]
    assert untied > tied * (1 + 1e-6), "without the tie declaration the embedding counts twice"


def _plain_pipeline_case():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    full = [torch.full((3,), 1.0, dtype=torch.float64), torch.full((2, 2), 2.0, dtype=torch.float64)]
    stage = mesh["pp"].get_local_rank()
    mine = [full[stage].clone()]
    total = nd.get_total_norm(mine, pp_mesh=mesh["pp"])
    assert_close(total, reference_norm(full, 2.0))
    nd.get_total_norm(mine, pp_mesh=mesh["pp"], process_group=dist.group.WORLD)
    return float(total)


def test_plain_replicated_tensors_on_pipeline_stages():
    run_on_ranks(4, _plain_pipeline_case)


def test_run_finder_tiles_views_and_respects_gaps_and_counting():
    base = torch.arange(20, dtype=torch.float32)
    views = [base[0:4], base[4:10], base[12:15], base[15:20], torch.ones(3), base[10:10]]
    counted = [True, False, True, True, True, True]
    runs = RunFinder().runs(views, counted)
    assert [(r.data_ptr() - base.data_ptr()) // 4 for r in runs.to_scale[:2]] == [0, 12]
    assert [r.numel() for r in runs.to_scale] == [10, 8, 3]
    assert [r.numel() for r in runs.to_norm] == [4, 8, 3]
    norm = torch.linalg.vector_norm(torch.cat([r for r in runs.to_norm]))
    assert torch.equal(norm, torch.linalg.vector_norm(torch.cat([v for v, c in zip(views, counted) if c])))
    # a new buffer with the same layout is re-validated, one with another layout regrouped
    base2 = base.clone()
    moved = [base2[0:4], base2[4:10], base2[12:15], base2[15:20], torch.ones(3), base2[10:10]]
    finder = RunFinder()
    finder.runs(views, counted)
    assert finder.runs(moved, counted).to_scale[0].data_ptr() == base2.data_ptr()
    overlapping = [base[0:6], base[4:10]]
    assert len(RunFinder().runs(overlapping, [True, True]).to_norm) == 2



def _steps_case():
    plans = nd.NormPlans()  # a shared cache could hit on layouts of earlier calls, or first probe (one all-reduce)
    reference = reference_norm(list(_reference_grads(_mlp(), 2).values()), 2.0)
    model, dp_rank = _parallel_model(1, 2, 2)
    x, y = _batch()
    counts = []
    for _ in range(3):  # new gradient buffers every step: the cached runs must be re-validated
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x.chunk(2)[dp_rank]), y.chunk(2)[dp_rank]).backward()
        with CommDebugMode() as comm:
            total = nd.clip_grad_norm_(model.parameters(), 1e9, plans=plans)
        assert_close(total, reference)
        counts.append(comm.get_total_counts())
    return counts


def test_plan_is_agreed_once_then_one_collective_per_step():
    # step 1: all_gather_object (2 collectives) + the all-reduce; later steps: the all-reduce only
    assert run_on_ranks(4, _steps_case) == [[3, 1, 1]] * 4


def _empty_stage_case():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    full = torch.arange(6, dtype=torch.float64)
    mine = [full.clone()] if mesh.get_local_rank() == 0 else []  # stage 1 holds no parameter
    for p in (2.0, math.inf):
        assert_close(nd.get_total_norm(mine, p, pp_mesh=mesh), reference_norm([full], p))


def test_a_stage_without_parameters_neither_hangs_nor_raises():
    run_on_ranks(2, _empty_stage_case)
