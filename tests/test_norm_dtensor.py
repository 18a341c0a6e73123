"""Golden tests of the global norm on hand-placed DTensors: every placement, several meshes in one
call, uneven shards, Partial refusal, non-finite propagation, collective counts.

Each rank builds the same full float64 gradients from a fixed seed (the single-device reference),
distributes them, and compares the distributed norm with the reference norm of the full tensors.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import lightning_ndclip as nd

NORM_TYPES = (2.0, 1.0, 3.0, 0.5, math.inf)


def reference_norm(tensors: list[torch.Tensor], p: float) -> torch.Tensor:
    """Single-device float64 norm of the concatenation."""
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    return torch.linalg.vector_norm(flat, p)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-12) -> None:
    a, e = float(actual), float(expected)
    assert abs(a - e) <= rtol * abs(e), f"{a!r} != {e!r} (relative error {abs(a - e) / abs(e):.3e})"


def _full(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _mixed_meshes_case():
    """World 8: a 3-D mesh (dp_replicate, dp_shard, tp), a 1-D slice of it, a separate expert
    mesh, and plain tensors, all in one call."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    experts = init_device_mesh("cpu", (2, 4), mesh_dim_names=("edp", "ep"))
    specs = [
        ((7, 6), mesh, [Replicate(), Shard(0), Shard(1)]),  # HSDP x TP, uneven rows
        ((9, 4), mesh, [Replicate(), Shard(0), Replicate()]),  # TP-replicated, FSDP-sharded
        ((4, 5), mesh, [Replicate(), Replicate(), Replicate()]),
        ((3, 5), mesh["dp_shard"], [Shard(0)]),  # FSDP only, other mesh
        ((1, 3), mesh["tp"], [Shard(0)]),  # one row over two ranks: an empty shard
        ((8, 3, 2), experts, [Shard(1), Shard(0)]),  # experts sharded on ep, FSDP on edp
        ((5,), None, None),  # plain, DDP style
    ]
    full = [_full(shape, i) for i, (shape, _, _) in enumerate(specs)]
    grads = [
        f.clone() if m is None else distribute_tensor(f, m, pl) for f, (_, m, pl) in zip(full, specs)
    ]
    out = {}
    for p in NORM_TYPES:
        ours = nd.get_total_norm(grads, p)
        assert_close(ours, reference_norm(full, p))
        out[p] = float(ours)
    naive = torch.zeros((), dtype=torch.float64)
    for g in grads:
        local = g.to_local() if hasattr(g, "to_local") else g
        naive += local.pow(2).sum()
    dist.all_reduce(naive)
    out["naive"] = float(naive.sqrt())
    with CommDebugMode() as comm:
        nd.get_total_norm(grads, 2.0)
    out["collectives"] = comm.get_total_counts()
    try:
        torch.nn.utils.get_total_norm(grads, 2.0)
        out["torch"] = "ok"
    except Exception as e:  # noqa: BLE001 - recording what torch does
        out["torch"] = type(e).__name__
    out["ref"] = float(reference_norm(full, 2.0))
    return out


def test_mixed_meshes_every_placement_and_norm_type():
    results = run_on_ranks(8, _mixed_meshes_case)
    assert all(r == results[0] for r in results), "ranks disagree"
    r = results[0]
    assert r["collectives"] == 1
    assert r["torch"] != "ok", "torch.nn.utils.get_total_norm was expected to refuse mixed meshes"
    assert abs(r["naive"] - r["ref"]) > 1e-3 * r["ref"], "the naive sum should double count"


def _uneven_case(world_size):
    """Shards that leave most ranks empty: every norm type, no exception, exact."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    full = [_full((1, 3), 1), _full((3,), 2), _full((0, 4), 3)]
    grads = [distribute_tensor(f, mesh, [Shard(0)]) for f in full]
    for p in NORM_TYPES:
        assert_close(nd.get_total_norm(grads, p), reference_norm(full, p))
    return [g.to_local().numel() for g in grads]


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_uneven_and_empty_shards(world_size):
    sizes = run_on_ranks(world_size, _uneven_case, world_size)
    if world_size > 1:
        assert any(s[0] == 0 for s in sizes), "the test should leave some rank with an empty shard"


def _partial_case():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    g = distribute_tensor(_full((4, 4), 0), mesh, [Replicate()])
    partial = DTensor.from_local(g.to_local() / 2, mesh, [Partial()]) if dist.get_rank() == 0 else g
    with pytest.raises(nd.NormPlanError) as info:
        nd.get_total_norm([partial])
    return str(info.value)


@pytest.mark.faults
def test_partial_refused_on_every_rank_naming_the_tensor():
    messages = run_on_ranks(2, _partial_case, timeout=60)
    for m in messages:
        assert "rank 0" in m and "tensor[0]" in m and "Partial" in m and "'tp'" in m


def _mismatch_case():
    grads = [torch.ones(3, dtype=torch.float64)] * (2 if dist.get_rank() == 1 else 1)
    mesh = init_device_mesh("cpu", (2,))
    grads.append(distribute_tensor(torch.ones(4, dtype=torch.float64), mesh, [Shard(0)]))
    with pytest.raises(nd.NormPlanError) as info:
        nd.get_total_norm(grads)
    return str(info.value)


@pytest.mark.faults
def test_ranks_that_disagree_fail_together_with_the_difference_named():
    for m in run_on_ranks(2, _mismatch_case, timeout=60):
        assert "rank 1 holds 3 gradient tensors but rank 0" in m


def _exchanged_bytes_case(n_tensors: int, disagree: bool) -> list[int]:
    """Pickled sizes of what the first call sends with ``all_gather_object``, and its norm's error."""
    import pickle
    from unittest import mock

    sent: list[int] = []
    gather = dist.all_gather_object

    def spy(out, obj, group=None):
        sent.append(len(pickle.dumps(obj)))
        return gather(out, obj, group=group)

    mesh = init_device_mesh("cpu", (2,))
    full = [_full((4, 3), i) for i in range(n_tensors)]
    grads = [distribute_tensor(f, mesh, [Shard(0)]) for f in full]
    if disagree and dist.get_rank() == 1:
        grads[-1] = DTensor.from_local(full[-1], mesh, [Replicate()], run_check=False)  # no collective
    with mock.patch.object(dist, "all_gather_object", spy):
        if disagree:
            with pytest.raises(nd.NormPlanError, match="differs between rank 0"):
                nd.get_total_norm(grads, plans=nd.NormPlans())
        else:
            assert_close(nd.get_total_norm(grads, plans=nd.NormPlans()), reference_norm(full, 2.0))
    return sent


def test_agreeing_ranks_exchange_a_summary_that_does_not_grow_with_the_tensors():
    """Ranks that agree send a fixed-size summary; ranks that disagree then send their whole views,
    so the error still names the tensor and the ranks."""
    small, large = (run_on_ranks(2, _exchanged_bytes_case, n, False)[0] for n in (4, 400))
    assert len(small) == len(large) == 1 and abs(large[0] - small[0]) < 64, (small, large)
    summary, whole = run_on_ranks(2, _exchanged_bytes_case, 400, True)[0]
    assert whole > 10 * summary


def _shared_spec_case() -> list[tuple]:
    from lightning_ndclip._compat import dtensor_spec
    from lightning_ndclip.core.norm._plan import describe

    mesh = init_device_mesh("cpu", (2,))
    a = distribute_tensor(_full((4, 3), 0), mesh, [Shard(0)])
    b = DTensor(a.to_local().to(torch.float32), dtensor_spec(a), requires_grad=False)  # a's spec, another dtype
    c = distribute_tensor(_full((4, 3), 1), mesh, [Shard(0)])
    return [layout.signature for layout in describe([a, b, c], dist.get_rank())]


def test_tensors_sharing_a_spec_are_described_by_their_own_dtype():
    for signatures in run_on_ranks(2, _shared_spec_case):
        assert signatures[0][2] == "torch.float64" and signatures[1][2] == "torch.float32"
        assert signatures[2] == signatures[0]


def _tie_mismatch_case() -> str:
    mesh = init_device_mesh("cpu", (2,))
    grads = [distribute_tensor(_full((4, 3), i), mesh, [Shard(0)]) for i in range(3)]
    tied = {"shared": grads[1]} if dist.get_rank() == 1 else None
    with pytest.raises(nd.NormPlanError) as info:
        nd.get_total_norm(grads, tied=tied, plans=nd.NormPlans())
    return str(info.value)


def test_ranks_that_declare_different_ties_raise_naming_the_tensor():
    for message in run_on_ranks(2, _tie_mismatch_case, timeout=60):
        assert "tensor #1 (tensor[1]) is tied as None on rank 0 but as 'shared' on rank 1" in message


def _diverged_plans_case(norm_type, layout_of_rank):
    """Every rank caches the plans of three layouts, then the ranks pick different ones in the same
    call: every cache hits, so only the check riding on the all-reduce can notice."""
    plans = nd.NormPlans()
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    layouts = [
        [distribute_tensor(_full((8, 3), 0), mesh, [Shard(0)])],
        [distribute_tensor(_full((8, 3), 0), mesh, [Shard(1)])],
        [distribute_tensor(_full((8, 3), 0), mesh, [Shard(0)]), _full((2,), 1)],
    ]
    for grads in layouts:
        nd.get_total_norm(grads, norm_type, plans=plans)
    with pytest.raises(RuntimeError, match="different cached norm plans") as info:
        nd.get_total_norm(layouts[layout_of_rank[dist.get_rank()]], norm_type, plans=plans)
    return str(info.value)


@pytest.mark.faults
@pytest.mark.parametrize("layout_of_rank", [(0, 0, 0, 1), (0, 1, 2, 0)], ids=["two-plans", "three-plans"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_ranks_on_different_cached_plans_raise_everywhere(norm_type, layout_of_rank):
    assert len(run_on_ranks(4, _diverged_plans_case, norm_type, layout_of_rank, timeout=60)) == 4


def _sharded_parameters(mesh, shapes: dict) -> list:
    """``[(name, parameter)]`` sharded on dim 0, each with the gradient ``_full(shape, its index)``."""
    named = []
    for seed, (name, shape) in enumerate(shapes.items()):
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(shape, dtype=torch.float64), mesh, [Shard(0)]))
        p.grad = distribute_tensor(_full(shape, seed), mesh, [Shard(0)])
        named.append((name, p))
    return named


def _changed_layout_case(norm_type, per_tensor, who_changes):
    """After a plan is cached, the ranks in ``who_changes`` have one gradient fewer (its ``grad`` is
    None). All ranks changing: a new plan, the right norm. Some ranks changing: the same error on
    every rank, never a wait."""
    plans = nd.NormPlans()
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    params = _sharded_parameters(mesh, {"p0": (8, 3), "p1": (4, 2), "p2": (5,)})
    nd.grad_norms(params, norm_type, per_tensor=per_tensor, plans=plans)  # the plan, cached on every rank
    if dist.get_rank() in who_changes:
        params[2][1].grad = None
    if len(who_changes) == dist.get_world_size():
        return float(nd.grad_norms(params, norm_type, per_tensor=per_tensor, plans=plans).total)
    with pytest.raises(RuntimeError, match="different cached norm plans") as info:
        nd.grad_norms(params, norm_type, per_tensor=per_tensor, plans=plans)
    return str(info.value)


@pytest.mark.faults
@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_a_rank_whose_gradient_set_changes_raises_everywhere_instead_of_hanging(norm_type, per_tensor):
    for message in run_on_ranks(4, _changed_layout_case, norm_type, per_tensor, (1,), timeout=60):
        assert "tensor" in message
    expected = reference_norm([_full((8, 3), 0), _full((4, 2), 1)], norm_type)
    for total in run_on_ranks(4, _changed_layout_case, norm_type, per_tensor, (0, 1, 2, 3), timeout=60):
        assert_close(torch.tensor(total, dtype=torch.float64), expected)


def _recorded_mesh_case():
    """The record of a norm's last all-reduce is kept per pp mesh: while the record stands, that
    mesh must stay alive, or a new mesh on one rank only could take its id, find the stale record
    and probe (an all-reduce) while the other ranks exchange plans (a hang)."""
    import gc
    import weakref

    plans = nd.NormPlans()
    pp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    grads = [_full((3, 2), dist.get_rank())]
    total = float(nd.get_total_norm(grads, 2.0, pp_mesh=pp_mesh, plans=plans))
    gone = weakref.ref(pp_mesh)
    del pp_mesh
    for n in range(1, plans.capacity + 2):  # other layouts evict its cached plan
        nd.get_total_norm([torch.ones(n)], 2.0, plans=plans)
    gc.collect()
    return total, gone() is not None


@pytest.mark.faults
def test_the_norm_keeps_the_mesh_of_its_record_alive_so_no_new_mesh_takes_its_id():
    expected = reference_norm([_full((3, 2), 0), _full((3, 2), 1)], 2.0)
    for total, alive in run_on_ranks(2, _recorded_mesh_case, timeout=60):
        assert_close(torch.tensor(total, dtype=torch.float64), expected)
        assert alive


def _swapped_names_case():
    """Two same-shape parameters passed in another order on rank 1: by position their per-parameter
    norms would be swapped (the total stays right); by name the ranks disagree, and all say so."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    named = _sharded_parameters(mesh, {"a": (4, 3), "b": (4, 3)})
    if dist.get_rank() == 1:
        named.reverse()
    with pytest.raises(nd.NormPlanError) as info:
        nd.grad_norms(named)
    return str(info.value)


@pytest.mark.faults
def test_per_parameter_norms_go_by_name_and_ranks_that_disagree_raise_everywhere():
    for message in run_on_ranks(2, _swapped_names_case, timeout=60):
        assert "tensor #0 is 'a' on rank 0 but 'b' on rank 1" in message


def _nonfinite_case(bad):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    full = _full((8, 3), 0)
    grad = distribute_tensor(full, mesh, [Shard(0)])
    if dist.get_rank() == 2:
        grad.to_local()[0, 0] = bad
    out = [float(nd.get_total_norm([grad], p)) for p in (2.0, math.inf)]
    with pytest.raises(RuntimeError, match="non-finite"):
        nd.get_total_norm([grad], error_if_nonfinite=True)
    return out


@pytest.mark.faults
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_on_one_rank_is_nonfinite_everywhere(bad):
    for two, inf in run_on_ranks(4, _nonfinite_case, bad):
        assert not math.isfinite(two) and not math.isfinite(inf)
        if math.isnan(bad):
            assert math.isnan(two) and math.isnan(inf)


def _nonfinite_copy_case(bad, tp_rank):
    """A tensor-parallel Replicate gradient: only one tp rank's copy is counted; a non-finite value
    in any copy must still make the norm non-finite on every rank."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    sharded = distribute_tensor(_full((8, 3), 0), mesh, [Shard(0), Shard(1)])
    replicated = distribute_tensor(_full((5,), 1), mesh, [Shard(0), Replicate()])
    nd.get_total_norm([sharded, replicated])  # the plan, cached
    if mesh["tp"].get_local_rank() == tp_rank:
        replicated.to_local()[0] = bad
    out = [float(nd.get_total_norm([sharded, replicated], p)) for p in (2.0, math.inf)]
    with pytest.raises(RuntimeError, match="non-finite"):
        nd.get_total_norm([sharded, replicated], error_if_nonfinite=True)
    return out


@pytest.mark.faults
@pytest.mark.parametrize("tp_rank", [0, 1])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_nonfinite_copy_that_is_not_counted_is_nonfinite_everywhere(bad, tp_rank):
    for two, inf in run_on_ranks(4, _nonfinite_copy_case, bad, tp_rank):
        assert not math.isfinite(two) and not math.isfinite(inf)


def _nonfinite_per_parameter_case():
    """Parameter k holds a nan on rank k only (one per rank position); the last one is clean."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    full = [_full((8, 3), k) for k in range(5)]
    grads = [distribute_tensor(f, mesh, [Shard(0)]) for f in full]
    for k in range(4):
        if dist.get_rank() == k:
            grads[k].to_local()[0, 0] = math.nan
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, g in zip(params, grads):
        param.grad = g
    out = {}
    for p in (2.0, math.inf):
        norms = nd.grad_norms([(f"w{k}", param) for k, param in enumerate(params)], p)
        assert_close(norms.per_tensor[4], reference_norm(full[4:], p))
        out[p] = [float(v) for v in norms.per_tensor[:4]] + [float(norms.total)]
    return out


@pytest.mark.faults
def test_a_nan_in_one_shard_makes_that_parameters_norm_nonfinite_everywhere():
    """A MAX all-reduce may drop a nan (gloo keeps whichever operand it holds): per-parameter inf
    norms carry it as inf. 2-norms and totals stay nan."""
    for out in run_on_ranks(4, _nonfinite_per_parameter_case):
        assert all(math.isnan(v) for v in out[2.0])
        assert all(not math.isfinite(v) for v in out[math.inf]) and math.isnan(out[math.inf][-1])


def _replicated_only_case():
    full = [_full((6, 2), 0), _full((3,), 1)]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    grads = [full[0].clone(), distribute_tensor(full[1], mesh, [Replicate()])]
    nd.get_total_norm(grads)  # plan
    with CommDebugMode() as comm:
        ours = nd.get_total_norm(grads)
    assert_close(ours, reference_norm(full, 2.0))
    return comm.get_total_counts()


def test_replicated_only_needs_no_collective():
    assert run_on_ranks(4, _replicated_only_case) == [0] * 4


def _bf16_case():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    full = [_full((64, 32), i).to(torch.bfloat16) for i in range(3)]
    grads = [distribute_tensor(f, mesh, [Shard(0), Shard(1)]) for f in full]
    ours = nd.get_total_norm(grads)
    assert ours.dtype == torch.float32
    assert_close(ours, reference_norm(full, 2.0), rtol=1e-6)
    wide = nd.get_total_norm(grads, accumulate_dtype=torch.float64)
    assert_close(wide, reference_norm(full, 2.0), rtol=1e-12)


def test_bf16_accumulates_in_fp32_or_fp64():
    run_on_ranks(4, _bf16_case)


def _huge_case(dtype):
    """Finite gradients whose squares overflow float32 (elements ~1e20, norm ~1e22): the norm is
    computed again in float64 where the total is read (CPU; retry_overflow=True), per parameter too;
    ``retry_overflow=False`` leaves the float32 sum's inf."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    full = [(_full((64, 32), i) * 1e20).to(dtype) for i in range(2)] + [_full((8, 4), 2).to(dtype)]
    named = []
    for i, f in enumerate(full):
        p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(f), mesh, [Shard(0), Shard(1)]))
        p.grad = distribute_tensor(f, mesh, [Shard(0), Shard(1)])
        named.append((f"p{i}", p))
    grads = [p.grad for _, p in named]
    norms = nd.grad_norms(named, per_tensor=True)
    return {
        "total": float(nd.get_total_norm(grads)),
        "clip": float(nd.clip_grad_norm_([p for _, p in named], 1e30)),
        "per_tensor": [float(v) for v in norms.per_tensor],
        "grad_norms_total": float(norms.total),
        "finite": norms.finite,  # read once, after the float64 retry
        "no_retry": float(nd.get_total_norm(grads, retry_overflow=False)),
        "not_read": nd.grad_norms(named, retry_overflow=False).finite,
    }


@pytest.mark.faults
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_gradients_whose_squares_overflow_float32_give_the_exact_norm(dtype):
    full = [(_full((64, 32), i) * 1e20).to(dtype) for i in range(2)] + [_full((8, 4), 2).to(dtype)]
    expected = reference_norm(full, 2.0)
    assert math.isinf(float(torch.nn.utils.get_total_norm(full)))  # torch's float32 sums overflow
    for r in run_on_ranks(4, _huge_case, dtype):
        for key in ("total", "clip", "grad_norms_total"):
            assert_close(torch.tensor(r[key], dtype=torch.float64), expected, rtol=1e-6)
        for got, f in zip(r["per_tensor"], full):
            assert_close(torch.tensor(got, dtype=torch.float64), reference_norm([f], 2.0), rtol=1e-6)
        assert math.isinf(r["no_retry"])
        assert r["finite"] is True and r["not_read"] is None


def _cycling_layouts_case(max_capacity):
    """40 layouts used in turn, as with one optimizer per layer: collectives per round of 40 calls."""
    plans = nd.NormPlans(capacity=16, max_capacity=max_capacity)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    layouts = [[distribute_tensor(_full((2, n), n), mesh, [Shard(0)])] for n in range(1, 41)]
    counts = []
    for _ in range(4):
        with CommDebugMode() as comm:
            for grads in layouts:
                nd.get_total_norm(grads, plans=plans)
        counts.append(comm.get_total_counts())
    return counts


def test_a_cycle_of_more_layouts_than_the_cache_holds_settles_to_one_collective_per_call():
    counts = run_on_ranks(2, _cycling_layouts_case, 4096, timeout=60)[0]
    assert counts[-2:] == [40, 40], counts
    fixed = run_on_ranks(2, _cycling_layouts_case, 16, timeout=60)[0]  # a fixed LRU of 16 rebuilds every plan
    assert min(fixed[1:]) > 3 * 40, fixed


def _equal_layout_case() -> tuple[bool, bool, int, list[int]]:
    from lightning_ndclip._compat import dtensor_spec

    plans = nd.NormPlans()
    mesh = init_device_mesh("cpu", (2,))
    first, second = ([distribute_tensor(_full((2, 3), seed), mesh, [Shard(0)])] for seed in (0, 1))
    counts = []
    for grads in (first, second, first):
        with CommDebugMode() as comm:
            nd.get_total_norm(grads, plans=plans)
        counts.append(comm.get_total_counts())
    spec, other = dtensor_spec(first[0]), dtensor_spec(second[0])
    return spec is other, spec == other, len(plans), counts


def test_new_gradients_of_an_equal_layout_find_its_plan():
    """The plans are keyed by value: a DTensor made anew with an equal spec (another object) is the same layout,
    found without an exchange (keyed by the spec's id, as before, it took a second plan and a second exchange)."""
    for identical, equal, kept, counts in run_on_ranks(2, _equal_layout_case):
        assert not identical and equal
        assert kept == 1 and counts[1] == counts[2] == 1 < counts[0], counts  # one all-reduce once the plan is known


def _tied_without_gradient_case() -> float:
    torch.manual_seed(dist.get_rank())
    lin = torch.nn.Linear(3, 3, dtype=torch.float64)
    lin(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    embed = torch.nn.Parameter(torch.ones(3, dtype=torch.float64), requires_grad=False)  # tied, no gradient
    holds = dist.get_rank() != 1  # ranks 0 and 2 hold a copy, as the first and last pipeline stages
    params = [lin.weight, lin.bias] + ([embed] if holds else [])
    pp_mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("pp",))
    total = nd.clip_grad_norm_(params, 1e9, pp_mesh=pp_mesh, tied_parameters={"embed": embed} if holds else None)
    return float(total)


def test_a_tied_parameter_without_a_gradient_is_left_out_on_every_rank():
    # its holders raised "tied entries are not among the parameters passed" while the others waited
    totals = run_on_ranks(3, _tied_without_gradient_case, timeout=60)
    grads = []
    for rank in range(3):
        torch.manual_seed(rank)
        lin = torch.nn.Linear(3, 3, dtype=torch.float64)
        lin(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
        grads += [lin.weight.grad, lin.bias.grad]
    expected = reference_norm(grads, 2.0)
    for total in totals:
        assert_close(torch.tensor(total, dtype=torch.float64), expected)

