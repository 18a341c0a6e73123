"""RunFinder: coalescing is exact, never touches a gap, and a stale grouping is never used."""

from __future__ import annotations

import math

import torch

from lightning_ndclip._compat import foreach_mul_
from lightning_ndclip.core.norm._runs import RunFinder


def _elements(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Every element of ``tensors``, sorted: equal iff the tensors cover the same values."""
    return torch.cat([t.reshape(-1) for t in tensors]).sort().values


def _fsdp_like(sizes: list[int], gaps: list[int], fill: float = math.nan) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Views of one flat buffer, ``gaps[k]`` padding elements (holding ``fill``) after view k."""
    buffer = torch.full((sum(sizes) + sum(gaps),), fill, dtype=torch.float64)
    views, at = [], 0
    for n, gap in zip(sizes, gaps):
        buffer[at : at + n] = torch.randn(n, dtype=torch.float64)
        views.append(buffer[at : at + n].view(n // 2, 2) if n % 2 == 0 else buffer[at : at + n])
        at += n + gap
    return buffer, views


def _check(
    finder: RunFinder, views: list[torch.Tensor], counted: list[bool], padding: list[int] | None = None
) -> tuple[list, list]:
    runs = finder.runs(views, counted, padding)
    assert torch.equal(_elements(runs.to_norm), _elements([v for v, c in zip(views, counted) if c]))
    uncounted = [v for v, c in zip(views, counted) if not c and v.numel()]
    assert torch.equal(_elements(runs.to_check), _elements(uncounted)) if uncounted else runs.to_check == []
    if padding is None:
        assert torch.equal(_elements(runs.to_scale), _elements(views))
    return runs.to_norm, runs.to_scale


def test_views_tiling_a_buffer_are_one_run_the_buffer_itself():
    buffer, views = _fsdp_like([6, 4, 10], [0, 0, 0])
    to_norm, to_scale = _check(RunFinder(), views, [True] * 3)
    assert len(to_norm) == len(to_scale) == 1 and to_scale[0] is buffer


def test_runs_stop_at_gaps_and_scaling_leaves_padding_untouched():
    buffer, views = _fsdp_like([6, 4, 10, 8], [0, 3, 0, 2])  # NaN padding after views 1 and 3
    _, to_scale = _check(RunFinder(), views, [True] * 4)
    assert len(to_scale) == 2  # [v0 v1] gap [v2 v3] gap
    foreach_mul_(to_scale, 0.5)
    assert torch.isnan(buffer).sum() == 5  # the padding still holds its NaNs


def test_declared_padding_joins_the_scale_runs_only_when_its_size_matches_the_gap():
    buffer, views = _fsdp_like([6, 4, 10, 8], [0, 3, 0, 2], fill=1.0)
    to_norm, to_scale = _check(RunFinder(), views, [True] * 4, padding=[0, 3, 0, 2])
    assert len(to_scale) == 1 and to_scale[0] is buffer  # padding after views 1 and 3 included
    assert len(to_norm) == 2  # the norm never reads the padding
    foreach_mul_(to_scale, 0.5)
    assert int((buffer == 0.5).sum()) == 5  # the padding was scaled along (harmless: nobody reads it)

    buffer, views = _fsdp_like([6, 4, 10, 8], [0, 3, 0, 2], fill=1.0)
    _, to_scale = _check(RunFinder(), views, [True] * 4, padding=[0, 2, 0, 3])  # not the gaps' sizes
    assert len(to_scale) == 2
    foreach_mul_(to_scale, 0.5)
    assert int((buffer == 1.0).sum()) == 5  # gaps that are not declared padding are never written


def test_uncounted_views_split_the_norm_runs_but_not_the_scale_runs():
    _, views = _fsdp_like([6, 4, 10, 8], [0, 0, 0, 0])
    to_norm, to_scale = _check(RunFinder(), views, [True, False, True, True])
    assert (len(to_norm), len(to_scale)) == (2, 1)


def test_a_fresh_buffer_with_the_same_layout_reuses_the_grouping_on_the_new_data():
    finder = RunFinder()
    _check(finder, _fsdp_like([6, 4, 10], [0, 2, 0])[1], [True] * 3)
    groups = finder._groups
    _, views = _fsdp_like([6, 4, 10], [0, 2, 0])  # as FSDP2 does every step
    _check(finder, views, [True] * 3)
    assert finder._groups is groups


def test_a_replaced_member_invalidates_the_grouping():
    finder = RunFinder()
    _, views = _fsdp_like([6, 4, 10], [0, 0, 0])
    _check(finder, views, [True] * 3)
    views[1] = torch.randn(2, 2, dtype=torch.float64)  # e.g. a user assigning p.grad
    to_norm, _ = _check(finder, views, [True] * 3)  # a stale grouping would norm the old buffer
    assert len(to_norm) == 3


def test_a_non_contiguous_member_at_the_same_address_invalidates_the_grouping():
    finder = RunFinder()
    buffer, views = _fsdp_like([8, 8], [0, 0])
    _check(finder, views, [True] * 2)
    views[0] = buffer[:16].view(4, 4)[:, :2]  # same first address, half the elements, strided
    _check(finder, views, [True] * 2)


def test_a_member_moved_inside_its_buffer_invalidates_the_grouping():
    finder = RunFinder()
    buffer, views = _fsdp_like([4, 4], [0, 4])
    _check(finder, views, [True] * 2)
    buffer[8:12] = torch.randn(4, dtype=torch.float64)
    views[1] = buffer[8:12].view(2, 2)  # into what was padding
    to_norm, _ = _check(finder, views, [True] * 2)
    assert len(to_norm) == 2


def test_overlapping_views_and_plain_tensors_are_their_own_runs():
    base = torch.randn(10, dtype=torch.float64)
    tensors = [base[0:6], base[4:10], torch.randn(3, dtype=torch.float64), torch.empty(0, dtype=torch.float64)]
    to_norm, to_scale = _check(RunFinder(), tensors, [True] * 4)
    assert len(to_norm) == len(to_scale) == 3  # the empty tensor is skipped


def test_clip_grads_with_norm_scales_buffer_views_exactly_and_leaves_padding_alone():
    import lightning_ndclip as nd

    buffer, views = _fsdp_like([6, 4, 10, 8], [0, 3, 0, 2])
    params = [torch.nn.Parameter(torch.zeros_like(v)) for v in views]
    for p, v in zip(params, views):
        p.grad = v
    expected = [v * 0.0625 for v in views]
    total = torch.tensor(2.0 - 1e-6, dtype=torch.float64)  # coefficient 0.5 / (total + 1e-6) = 1/4
    nd.clip_grads_with_norm_(params, 0.5, total)
    nd.clip_grads_with_norm_(params, 0.5, total)  # the cached grouping, re-validated
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected))
    assert torch.isnan(buffer).sum() == 5


def test_grad_norms_clip_scales_what_it_normed_like_clip_grads_with_norm_():
    import lightning_ndclip as nd

    grads = {}
    for way in ("clip_", "clip_grads_with_norm_"):
        torch.manual_seed(0)  # the same gradients both ways
        buffer, views = _fsdp_like([6, 4, 10, 8], [0, 3, 0, 2])
        params = [torch.nn.Parameter(torch.zeros_like(v)) for v in views]
        for p, v in zip(params, views):
            p.grad = v
        norms = nd.grad_norms([(f"p{i}", p) for i, p in enumerate(params)], per_tensor=False)
        if way == "clip_":
            coef = norms.clip_(0.5)
            assert float(coef) < 1
        else:
            nd.clip_grads_with_norm_(params, 0.5, norms.total)
        grads[way] = [p.grad.clone() for p in params]
        assert torch.isnan(buffer).sum() == 5  # the padding between the views is never scaled
    assert all(torch.equal(a, b) for a, b in zip(grads["clip_"], grads["clip_grads_with_norm_"]))


def test_several_buffers_gaps_uncounted_views_and_single_tensors_in_one_list():
    def make() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        tiled, a = _fsdp_like([6, 4], [0, 0])
        gapped, b = _fsdp_like([6, 4, 10], [0, 3, 0])  # NaN gap after its 2nd view
        mixed, c = _fsdp_like([8, 2, 6], [0, 0, 0])
        plain = torch.randn(5, dtype=torch.float64)
        return [tiled, gapped, mixed], [*b, plain, *a, *c]

    counted = [True, True, True, True, True, True, True, False, True]  # mixed's middle view is not counted
    finder = RunFinder()
    for _ in range(2):  # the second call validates the cached grouping on fresh buffers
        buffers, views = make()
        to_norm, to_scale = _check(finder, views, counted)
        assert (len(to_norm), len(to_scale)) == (6, 5)  # runs: tiled 1, gapped 2, mixed 2 (norm) / 1 (scale), plain 1
        foreach_mul_(to_scale, 2.0)
        assert int(torch.isnan(buffers[1]).sum()) == 3  # the gap was never written


def test_runs_follow_the_order_of_the_tensors_not_of_their_buffers_addresses():
    # the local sum adds the runs in this order: any other order (e.g. by address) would change its
    # last bits from one run of the program to the next
    torch.manual_seed(0)
    made = [_fsdp_like([4, 6], [0, 0]) for _ in range(24)]
    order = torch.randperm(len(made)).tolist()
    views = [v for k in order for v in made[k][1]]
    to_norm, to_scale = _check(RunFinder(), views, [True] * len(views))
    assert [t.data_ptr() for t in to_norm] == [made[k][0].data_ptr() for k in order]
    assert [t.data_ptr() for t in to_scale] == [made[k][0].data_ptr() for k in order]
