"""Muon on a mesh against Muon on one process: every matrix assembled once, the update of one device.

The float64 reference is Muon written the usual way on whole tensors in one process (Newton-Schulz on each 2-D
gradient, below), not the package's code; the bfloat16 one is torch.optim.Muon itself."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from harness import run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_ndclip import Muon, newton_schulz

SHAPES = {"0": (8, 6), "1": (6, 8), "2": (8, 6), "3": (9, 6), "4": (6, 6)}
"""The matrices of the test model: two of one shape and layout (one stack), a transposed one, rows that 4 ranks do
not divide, a square one."""
STEPS = 3
OPTIONS = dict(lr=0.02, weight_decay=0.1, momentum=0.9)


class ReferenceMuon:
    """Muon on whole float64 matrices in one process, written from its definition (nesterov momentum, the quintic
    Newton-Schulz of 5 steps, decoupled weight decay, the learning rate scaled by sqrt(max(1, rows / columns)))."""

    def __init__(self, lr: float = 0.02, weight_decay: float = 0.1, momentum: float = 0.9) -> None:
        self.lr, self.weight_decay, self.momentum = lr, weight_decay, momentum
        self.buffers: dict[str, torch.Tensor] = {}

    def step(self, name: str, weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``weight`` after one step on ``grad`` (a 3-D stack: each matrix on its own)."""
        if weight.ndim == 3:
            return torch.stack([self.step(f"{name}[{e}]", weight[e], grad[e]) for e in range(weight.shape[0])])
        mu = self.momentum
        buffer = self.buffers[name] = mu * self.buffers.get(name, torch.zeros_like(grad)) + (1 - mu) * grad
        update = (1 - mu) * grad + mu * buffer
        tall = update.shape[0] > update.shape[1]
        x = update.T if tall else update
        x = x / x.norm()
        a, b, c = 3.4445, -4.7750, 2.0315
        for _ in range(5):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        x = x.T if tall else x
        scale = math.sqrt(max(1.0, weight.shape[0] / weight.shape[1]))
        return weight * (1 - self.lr * self.weight_decay) - self.lr * scale * x


def _reference_muon(weight: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    reference = ReferenceMuon()
    for grad in grads:
        weight = reference.step("w", weight, grad)
    return weight


def _whole(step: int, name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole weight (at step 0) and the whole gradient of ``step``, the same on every rank."""
    generator = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    return torch.randn(shape, generator=generator, dtype=torch.float64), torch.randn(
        shape, generator=generator, dtype=torch.float64
    )


def _model(layout: str, dtype: torch.dtype = torch.float64) -> nn.Module:
    """Bias-free linears of :data:`SHAPES` in ``layout`` on 4 ranks, the weights of :func:`_whole`."""
    model = nn.Sequential(*[nn.Linear(s[1], s[0], bias=False) for s in SHAPES.values()]).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_whole(0, name.split(".")[0], tuple(p.shape))[0])
    if layout == "dp_shard":
        fully_shard(model, mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",)))
    elif layout == "dp_shard_tp":  # FSDP2 over tp: _StridedShard on the colwise ones
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        plan = {"0": ColwiseParallel(), "1": RowwiseParallel(), "2": ColwiseParallel(), "3": ColwiseParallel()}
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp_shard"])
    elif layout == "hsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard")))
    return model  # "replicas": plain tensors, a whole copy on every rank


def _set_gradients(model: nn.Module, step: int) -> None:
    for name, p in model.named_parameters():
        grad = _whole(step, name.split(".")[0], tuple(p.shape))[1].to(p.dtype)
        if isinstance(p, DTensor):  # this rank's part of the whole gradient, in the parameter's layout
            grad = DTensor.from_local(grad, p.device_mesh, [Replicate()] * p.device_mesh.ndim).redistribute(
                p.device_mesh, p.placements
            )
        p.grad = grad


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def _muon_on(layout: str, orthogonalize_shards: bool = False) -> dict[str, float]:
    """Max |difference| per weight after :data:`STEPS` steps against the reference. ``orthogonalize_shards``: the
    naive way instead, each rank's shard orthogonalized as if it were the matrix."""
    model = _model(layout)
    optimizer = Muon(model.named_parameters(), **OPTIONS, ns_dtype=None)
    for step in range(1, STEPS + 1):
        _set_gradients(model, step)
        if orthogonalize_shards:
            _naive_step(optimizer)
        else:
            optimizer.step()
    errors = {}
    for name, p in model.named_parameters():
        key = name.split(".")[0]
        weight, grads = _whole(0, key, SHAPES[key])[0], [_whole(s, key, SHAPES[key])[1] for s in range(1, STEPS + 1)]
        errors[key] = (_full(p) - _reference_muon(weight, grads)).abs().max().item()
    return errors


@torch.no_grad()
def _naive_step(optimizer: Muon) -> None:
    """Muon with each shard orthogonalized on its own (what Newton-Schulz on ``p.grad.to_local()`` computes)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            local, grad = (p.to_local(), p.grad.to_local()) if isinstance(p, DTensor) else (p.data, p.grad)
            buffer = optimizer.state[p].setdefault("buffer", torch.zeros_like(grad))
            buffer.lerp_(grad, 0.1)
            update = newton_schulz(grad.lerp(buffer, 0.9), dtype=None)
            local.mul_(1 - 0.02 * 0.1).add_(update, alpha=-0.02 * math.sqrt(max(1.0, p.shape[0] / p.shape[1])))


LAYOUTS = ["dp_shard", "dp_shard_tp", "hsdp", "replicas"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_muon_on_a_mesh_is_muon_on_one_device(layout):
    errors = run_on_ranks(4, _muon_on, layout)
    for rank_errors in errors:
        assert max(rank_errors.values()) < 1e-12, rank_errors


def test_orthogonalizing_each_shard_is_not_muon():
    errors = run_on_ranks(4, _muon_on, "dp_shard_tp", True)[0]
    assert min(errors.values()) > 1e-3, errors  # 0.017-0.025 here: about the size of the updates


def _bf16_case(layout: str) -> list[bool]:
    """fp32 weights, torch's bfloat16 Newton-Schulz: steps on ``layout`` against torch.optim.Muon on the whole
    matrices in this process."""
    model = _model(layout, torch.float32)
    whole = nn.Sequential(*[nn.Linear(s[1], s[0], bias=False) for s in SHAPES.values()])
    with torch.no_grad():
        for (_, p), w in zip(model.named_parameters(), whole.parameters()):
            w.copy_(_full(p))
    ours, theirs = Muon(model.parameters(), **OPTIONS), torch.optim.Muon(whole.parameters(), **OPTIONS)
    for step in range(1, STEPS + 1):
        _set_gradients(model, step)
        for (_, p), w in zip(model.named_parameters(), whole.parameters()):
            w.grad = _full(p.grad)
        ours.step()
        theirs.step()
    return [torch.equal(_full(p), w.detach()) for p, w in zip(model.parameters(), whole.parameters())]


@pytest.mark.parametrize("layout", ["dp_shard", "dp_shard_tp"])
def test_in_bfloat16_muon_on_a_mesh_is_torch_muon_bit_for_bit(layout):
    for equal in run_on_ranks(4, _bf16_case, layout):
        assert all(equal), equal


def _experts_case() -> float:
    """Packed experts ``[4, 6, 8]``: experts over ep (2), rows over the ranks holding the same experts (2), against
    each expert's matrix by the reference."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "edp"))
    weight, grads = _whole(0, "experts", (4, 6, 8))[0], [_whole(s, "experts", (4, 6, 8))[1] for s in range(1, 4)]
    p = nn.Parameter(distribute_tensor(weight, mesh, [Shard(0), Shard(1)]))
    optimizer = Muon([p], **OPTIONS, ns_dtype=None)
    for grad in grads:
        p.grad = distribute_tensor(grad, mesh, [Shard(0), Shard(1)])
        optimizer.step()
    expected = _reference_muon(weight, grads)
    return (p.full_tensor() - expected).abs().max().item()


def test_a_stack_of_expert_matrices_is_each_expert_orthogonalized():
    assert max(run_on_ranks(4, _experts_case)) < 1e-12


def _collectives_case(matrices: int) -> dict[str, int]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(matrices)]).double()
    parallelize_module(model, mesh["tp"], {str(i): ColwiseParallel() for i in range(matrices)})
    fully_shard(model, mesh=mesh["dp_shard"])
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer = Muon(model.parameters(), ns_dtype=None)
    with CommDebugMode() as comm:
        optimizer.step()
    return {str(op): n for op, n in comm.get_comm_counts().items()}


def test_a_step_communicates_per_stack_not_per_matrix():
    """8 or 32 matrices of one shape and layout: the same collectives (two redistributions of the stack)."""
    few, many = run_on_ranks(4, _collectives_case, 8)[0], run_on_ranks(4, _collectives_case, 32)[0]
    assert few == many and 0 < sum(few.values()) <= 4, (few, many)


def _exchange_case(matrices: int) -> tuple[int, dict[str, int]]:
    """FSDP2 alone (one mesh dim): the package's own all-to-all, twice per stack, and no other collective."""
    model = nn.Sequential(*[nn.Linear(8, 9, bias=False) for _ in range(matrices)]).double()
    fully_shard(model, mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",)))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    calls = []
    exchange = torch.distributed.all_to_all_single
    with mock.patch.object(torch.distributed, "all_to_all_single", lambda *a, **k: calls.append(1) or exchange(*a, **k)):
        with CommDebugMode() as comm:
            Muon(model.parameters(), ns_dtype=None).step()
    return len(calls), {str(op): n for op, n in comm.get_comm_counts().items()}


def test_on_fsdp2_alone_each_stack_is_two_all_to_alls_whatever_its_size():
    for matrices in (3, 16):  # fewer matrices than ranks, and more
        for calls, dtensor in run_on_ranks(4, _exchange_case, matrices):
            assert calls == 2 and list(dtensor.values()) == [2] and "alltoall" in next(iter(dtensor)), (calls, dtensor)


def test_muon_refuses_what_is_not_a_matrix_naming_it():
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"'bias' has shape \(3,\): put it in a param group with 'muon': False"):
        Muon(model.named_parameters())


def _partial_case() -> str:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    from torch.distributed.tensor import Partial

    p = nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]))
    p.grad = DTensor.from_local(torch.ones(4, 4), mesh, [Partial()])
    try:
        Muon([("w", p)]).step()
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_gradient_not_yet_reduced_is_refused_on_every_rank():
    messages = run_on_ranks(4, _partial_case)
    assert len(set(messages)) == 1 and "'w' is a partial sum over mesh dim(s) ['dp_shard']" in messages[0]


def test_on_one_process_muon_is_torch_muon_bit_for_bit():
    torch.manual_seed(0)
    ours, theirs = nn.Linear(6, 9, bias=False), nn.Linear(6, 9, bias=False)
    theirs.load_state_dict(ours.state_dict())
    a, b = Muon(ours.parameters(), **OPTIONS), torch.optim.Muon(theirs.parameters(), **OPTIONS)
    for _ in range(3):
        grad = torch.randn(9, 6)
        ours.weight.grad, theirs.weight.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    assert torch.equal(ours.weight, theirs.weight)


def _adamw_group_case() -> dict[str, float]:
    """A linear layer with a bias on dp_shard=4: the weight by Muon, the bias in a ``"muon": False`` group, against
    the reference and torch.optim.AdamW on one process."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    layer, whole = nn.Linear(6, 9).double(), nn.Linear(6, 9).double()
    whole.load_state_dict(layer.state_dict())
    fully_shard(layer, mesh=mesh)
    optimizer = Muon([{"params": [layer.weight]}, {"params": [layer.bias], "muon": False, "lr": 0.01}], **OPTIONS, ns_dtype=None)
    adamw = torch.optim.AdamW([whole.bias], lr=0.01, weight_decay=0.1)
    weight, grads = whole.weight.detach().clone(), []
    for step in range(1, STEPS + 1):
        grad = {n: _whole(step, n, tuple(p.shape))[1] for n, p in whole.named_parameters()}
        grads.append(grad["weight"])
        whole.bias.grad = grad["bias"]
        for name, p in layer.named_parameters():
            p.grad = distribute_tensor(grad[name], mesh, p.placements)
        optimizer.step()
        adamw.step()
    return {
        "weight": (layer.weight.full_tensor() - _reference_muon(weight, grads)).abs().max().item(),
        "bias": (layer.bias.full_tensor() - whole.bias.detach()).abs().max().item(),
    }


def test_a_group_that_is_not_muon_is_stepped_by_adamw():
    for errors in run_on_ranks(4, _adamw_group_case):
        assert max(errors.values()) < 1e-12, errors
