"""Split activations followed through the first forward (``core.parallel.split_activations``), pure PyTorch on 2 tp
ranks against the plain model on one process in float64: a ColwiseParallel projection whose output the model chunks
into q, k, v is named (the head-major ``view`` and a gathered output pass); a whole parameter between a colwise and a
rowwise layer (a learnable activation, a per-head norm weight) gets the exact gradient from the first step (without
the watch, each rank's is its features' part); one that also meets whole activations, or a per-head tensor of all
heads, is named. In the Trainer: test_split_activations_trainer.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_ndclip.core.parallel.split_activations import watch_split_activations

WIDTH, HEADS = 16, 4


class Attention(nn.Module):
    def __init__(self, split: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.proj, self.split = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH), split

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        qkv = self.qkv(h)
        if self.split == "head-major view":
            q, k, v = qkv.view(b, s, -1, 3, WIDTH // HEADS).permute(3, 0, 2, 1, 4)
        else:  # q, then k, then v: chunk / split along the features
            parts = qkv.chunk(3, -1) if self.split == "chunk" else torch.split(qkv, WIDTH, dim=-1)
            q, k, v = (t.view(b, s, -1, WIDTH // HEADS).transpose(1, 2) for t in parts)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, s, -1))


def _case(split: str, gathered: bool) -> str:
    model = Attention(split)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    qkv = ColwiseParallel(output_layouts=Replicate()) if gathered else ColwiseParallel()
    proj = RowwiseParallel(input_layouts=Replicate()) if gathered else RowwiseParallel()
    parallelize_module(model, mesh, {"qkv": qkv, "proj": proj})
    try:
        with watch_split_activations(model, mesh):
            loss = model(torch.randn(2, 5, WIDTH)).sum()
        loss.backward()
    except ValueError as error:
        return str(error)
    return "ran"


@pytest.mark.parametrize("split", ["chunk", "split"])
def test_a_colwise_output_cut_into_q_k_v_is_named_on_every_rank(split):
    name = "chunk(3, dim=-1)" if split == "chunk" else "split(16, dim=-1)"
    for message in run_on_ranks(2, _case, split, False):
        assert message.startswith("qkv is ColwiseParallel (each tensor-parallel rank holds a contiguous block"), message
        assert name in message and "Lay the fused rows out per head" in message


def test_the_head_major_view_and_a_gathered_output_are_not_refused():
    assert run_on_ranks(2, _case, "head-major view", False) == ["ran", "ran"]
    assert run_on_ranks(2, _case, "chunk", True) == ["ran", "ran"]  # the whole output on every rank: chunk is right


class _Between(nn.Module):
    """A colwise ``up``, then whole parameters on its split features (``alpha``, a learnable activation's slope; a
    per-head norm weight ``gain`` of one head's width), then a rowwise ``down``. ``mixed``: ``alpha`` also scales the
    whole input; ``per_head``: a tensor of every head's scale against this rank's heads."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.alpha = nn.Parameter(torch.tensor([0.3]))
        self.gain = nn.Parameter(torch.rand(WIDTH // HEADS) + 0.5)
        self.heads = nn.Parameter(torch.rand(2 * HEADS) + 0.5)
        self.kind = kind
        self.double()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.up(h)
        x = torch.where(x > 0, x, self.alpha * x)  # a learnable leaky slope, elementwise
        b, s, _ = x.shape
        x = (x.view(b, s, -1, WIDTH // HEADS) * (1 + self.gain)).flatten(2)  # per head, the weight over one head
        if self.kind == "per_head":
            x = (x.view(b, s, -1, WIDTH // HEADS) * self.heads[:, None]).flatten(2)
        out = self.down(x)
        return out * self.alpha if self.kind == "mixed" else out


INPUT = torch.randn(2, 5, WIDTH, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def _between_case(kind: str, watched: bool) -> dict:
    model = _Between(kind)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    try:
        for _ in range(2 if watched else 1):  # watched twice (a second fit of the module): summed once
            with watch_split_activations(model, mesh) if watched else contextlib.nullcontext():
                loss = model(INPUT).square().sum()  # the forward watched; backward after, as in a training step
        loss.backward()
    except ValueError as error:
        return {"error": str(error)}
    return {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}


def test_whole_parameters_on_split_features_get_the_exact_gradient():
    reference = _Between("plain")
    reference(INPUT).square().sum().backward()
    for grads in run_on_ranks(2, _between_case, "plain", True):
        for name, p in reference.named_parameters():
            if name != "heads":
                torch.testing.assert_close(grads[name], p.grad, rtol=1e-12, atol=1e-12, msg=name)
    unwatched = run_on_ranks(2, _between_case, "plain", False)
    assert not torch.allclose(unwatched[0]["alpha"], reference.alpha.grad)  # each rank's features' part alone


def test_a_whole_parameter_on_split_and_whole_activations_or_of_every_head_is_named():
    for result in run_on_ranks(2, _between_case, "mixed", True):
        assert result["error"].startswith("['alpha'] (left whole by the tensor-parallel plan") and "meet both" in result["error"]
    for result in run_on_ranks(2, _between_case, "per_head", True):
        assert result["error"].startswith("['heads'] (left whole") and "mul failed" in result["error"], result


class _WholeMeetsSplit(nn.Module):
    """A colwise ``q`` (heads split over tp) meets, outside any colwise layer, a whole activation: ``shared``'s output,
    one vector added to every head (as multi-head latent attention's rotary key), or ``scale``'s, one scale for each
    of all the heads (as a dynamic mask); or ``embed``'s weight, split over the vocabulary, read directly."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.q, self.out = nn.Embedding(8, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.shared, self.scale = nn.Linear(WIDTH, WIDTH // HEADS), nn.Linear(WIDTH, HEADS)
        self.kind = kind
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        b, s, _ = h.shape
        q = self.q(h).view(b, s, -1, WIDTH // HEADS)
        if self.kind == "shared":
            q = q + self.shared(h)[:, :, None, :]
        elif self.kind == "every head":
            q = q * self.scale(h)[..., None]
        elif self.kind == "read weight":
            q = q + self.embed.weight[0].view(-1, WIDTH // HEADS)[: q.shape[2]]
        return self.out(q.flatten(2))


TOKENS = torch.randint(0, 8, (2, 5), generator=torch.Generator().manual_seed(4))


def _whole_case(kind: str, watched: bool) -> dict:
    model = _WholeMeetsSplit(kind)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    plan = {"embed": RowwiseParallel(input_layouts=Replicate()), "q": ColwiseParallel(), "out": RowwiseParallel()}
    parallelize_module(model, mesh, plan)
    try:
        with watch_split_activations(model, mesh) if watched else contextlib.nullcontext():
            loss = model(TOKENS).square().sum()
        loss.backward()
    except ValueError as error:
        return {"error": str(error)}
    return {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}


def test_a_whole_activation_entering_split_heads_is_named_at_the_first_forward():
    reference = _WholeMeetsSplit("shared")
    reference(TOKENS).square().sum().backward()
    unwatched = run_on_ranks(2, _whole_case, "shared", False)[0]
    assert not torch.allclose(unwatched["shared.weight"], reference.shared.weight.grad)  # each rank's heads' part
    for result in run_on_ranks(2, _whole_case, "shared", True):
        assert result["error"].startswith("a whole activation (the same on every tp rank: of a layer the plan leaves whole")
        assert "shared's output, in add (the model's forward)" in result["error"], result
    for result in run_on_ranks(2, _whole_case, "every head", True):  # fails in mul: named, not a raw shape error
        assert result["error"].startswith("the output of ['scale'] (whole: the same on every tp rank"), result
        assert "mul failed" in result["error"], result
    for result in run_on_ranks(2, _whole_case, "read weight", True):
        assert result["error"].startswith("['embed.weight'] (split or replicated over tp by the plan"), result
    plain = _WholeMeetsSplit("plain")
    plain(TOKENS).square().sum().backward()
    for grads in run_on_ranks(2, _whole_case, "plain", True):  # no whole activation on split heads: exact, watched
        for name, p in plain.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(grads[name], p.grad, rtol=1e-12, atol=1e-12, msg=name)


class _RowwiseInside(nn.Module):
    """A module fed split activations that sums them itself (its rowwise layer inside), then a norm on the whole
    output: the norm's gradient is whole on every rank, not to be summed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.tail = nn.Sequential(nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.double()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tail(self.up(h)))


def _rowwise_inside_case() -> dict:
    model = _RowwiseInside()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "tail.1": RowwiseParallel()})
    with watch_split_activations(model, mesh):
        loss = model(INPUT).square().sum()
    loss.backward()
    return {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}


def test_a_module_that_sums_its_split_input_itself_returns_a_whole_activation():
    reference = _RowwiseInside()
    reference(INPUT).square().sum().backward()
    for grads in run_on_ranks(2, _rowwise_inside_case):
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-12, atol=1e-12, msg=name)
