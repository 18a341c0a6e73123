"""Parameters used on some ranks only, under FSDP2 (``core.parallel.unused.UnusedParameters``), pure PyTorch on 2
ranks, against the plain model on one process in float64: a parameter one rank uses inside a unit both run, a unit
whose output only one rank's loss reaches, a parameter no rank uses; and a unit one rank skips, refused on both.
Without it FSDP2 aborts (gloo: 'Received data size doesn't match expected size') or waits forever in the first two
cases, and in the last the all-gathers pair up units of the ranks that differ. ``UnusedParametersCheck`` on 4 ranks in
two reductions of 2: ranks that reduce together and differ are refused naming them; ranks that differ only from ranks
of another reduction are not. The Trainer: test_unused_trainer.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_ndclip.core.parallel.reduce import use_sum_reduction
from lightning_ndclip.core.parallel.unused import UnusedParameters, UnusedParametersCheck


class _Branches(nn.Module):
    """``a`` always; ``b`` where the batch asks (used inside the root unit); ``d`` always run, its output in the loss
    where the batch asks; ``e`` never used."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d, self.e = (nn.Linear(4, 4) for _ in range(5))
        self.double()

    def forward(self, x: torch.Tensor, use_b: bool, use_d: bool) -> torch.Tensor:
        h = self.a(x)
        if use_b:
            h = h + self.b(x)
        out = self.c(h)
        extra = self.d(out)
        return out.sum() + (extra.sum() if use_d else 0.0)


BATCHES = torch.randn(2, 2, 3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
USES = [[(True, True), (False, False)], [(False, False), (False, True)]]  # [micro-batch][rank]


def _reference() -> dict[str, torch.Tensor | None]:
    model = _Branches()
    for x, uses in zip(BATCHES, USES):
        for rank in range(2):
            model(x[rank], *uses[rank]).backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _units_case(units: tuple[str, ...]) -> dict:
    """Two micro-batches, each reduced; this rank's gradients (whole) or the error it raised."""
    model = _Branches()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name in units:
        fully_shard(model.get_submodule(name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    use_sum_reduction(model)
    unused = UnusedParameters(model)
    rank = dist.get_rank()
    try:
        for x, uses in zip(BATCHES, USES):
            with unused.forward():
                loss = model(x[rank], *uses[rank])
            unused.prepare_backward(loss).backward()
    except ValueError as error:
        return {"error": str(error)}
    return {n: None if p.grad is None else p.grad.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("units", [("a", "c"), ("a", "c", "d")], ids=["b-in-the-root-unit", "d-a-unit"])
def test_gradients_used_on_some_ranks_are_the_exact_sum_and_unused_ones_none(units):
    """``b``: one rank per micro-batch uses it inside the root unit (its gradient: that rank's). ``d``: a unit every
    rank runs, whose output only one rank's loss reaches. ``e``: no rank uses it, so it has no gradient, as on one
    device (an optimizer skips it), not a zero one."""
    expected = _reference()
    assert expected["e.weight"] is None and expected["b.weight"] is not None
    for grads in run_on_ranks(2, _units_case, units):
        assert grads.keys() == expected.keys()
        for name, value in expected.items():
            if value is None:
                assert grads[name] is None, name
            else:
                torch.testing.assert_close(grads[name], value, rtol=1e-12, atol=1e-12, msg=name)


def test_a_unit_some_ranks_skip_is_refused_on_every_rank_naming_it():
    """``b`` as a unit of its own: rank 0 runs it, rank 1 goes on to ``c``. Without the check each rank gathers the
    other unit's parameters (``b`` and ``c`` have the same size) and computes with them before a later collective
    aborts or waits forever."""
    # the ranks stop in different units, where FSDP2 may have issued a collective one rank never joins: its gloo
    # thread stays in it until the timeout, so the pool is replaced after the task
    for result in run_on_ranks(2, _units_case, ("a", "b", "c"), retire_pool=True):
        message = result["error"]
        assert "rank 0 was about to run the FSDP2 unit 'b'; rank 1 was about to run the FSDP2 unit 'c'" in message
        assert "leave it out of ParallelPlan(fsdp_units)" in message


def _check_case(uses_b: list[bool]) -> str | None:
    """4 ranks as 2 x 2, each unit reduced over the inner dim (ranks {0, 1} and {2, 3}); rank r uses ``b`` where
    ``uses_b[r]``; one window of two backwards, the second reducing. The error raised, if any."""
    model = _Branches()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    fully_shard(model.a, mesh=mesh["inner"])
    fully_shard(model, mesh=mesh["inner"])
    check = UnusedParametersCheck(model)
    rank = dist.get_rank()
    try:
        for step, x in enumerate(BATCHES):
            model.set_requires_gradient_sync(step == 1)
            check.prepare_backward(model(x[rank % 2], uses_b[rank] and step == 0, True), reduces=step == 1).backward()
    except ValueError as error:
        return str(error)
    return None


def test_the_check_refuses_ranks_of_one_reduction_that_differ_and_only_those():
    """Ranks 0 and 1 use ``b``, 2 and 3 do not: each reduction agrees, nothing to refuse (FSDP2 reduces fine). Rank
    2 alone uses it: its reduction ({2, 3}) would enter different sizes; refused on all 4 ranks, naming ``b``'s
    parameters and ranks 2 and 3 only."""
    assert run_on_ranks(4, _check_case, [True, True, False, False]) == [None] * 4
    for error in run_on_ranks(4, _check_case, [False, False, True, False]):
        assert error is not None and "['b.weight', 'b.bias']" in error and "on ranks [2] but not on ranks [3]" in error, error
