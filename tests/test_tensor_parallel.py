"""Tied parameters under tensor parallelism (``tensor_parallelize``, ``check_ties``): a tied embedding and LM
head stay one parameter, and the sharded model's loss and gradients equal the plain model's on one process in
float64; plain ``parallelize_module`` is shown computing different gradients on the same check."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import lightning_ndclip as nd

VOCAB, WIDTH = 12, 6


class TiedLM(nn.Module):
    """Embedding -> MLP -> LM head sharing the embedding's weight (the tied small-LLM shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.down(torch.tanh(self.up(h))))


def _model() -> TiedLM:
    torch.manual_seed(0)
    return TiedLM().double()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (3, 5), generator=g), torch.randint(0, VOCAB, (3, 5), generator=g)


def _loss_and_grads(model: nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    tokens, labels = _data()
    logits = model(tokens)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    loss = loss.detach()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = grad.detach().clone()
    return loss.item(), grads


PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel(), "head": ColwiseParallel(output_layouts=Replicate())}


def _sharded_case(keep_ties: bool) -> dict:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = _model()
    if keep_ties:
        nd.tensor_parallelize(model, mesh, PLAN)  # the embedding left out of the plan: completed to match the head
    else:
        parallelize_module(model, mesh, PLAN)
    loss, grads = _loss_and_grads(model)
    return {
        "tied": model.head.weight is model.embed.weight,
        "placements": [str(p.placements) for p in (model.embed.weight, model.head.weight) if isinstance(p, DTensor)],
        "loss": loss,
        "grads": grads,
    }


def test_a_tied_embedding_and_head_stay_one_parameter_and_equal_one_device():
    ref_loss, ref_grads = _loss_and_grads(_model())
    result = run_on_ranks(2, _sharded_case, True)[0]
    assert result["tied"] and result["placements"] == ["(Shard(dim=0),)"] * 2
    assert abs(result["loss"] - ref_loss) <= 1e-12 * abs(ref_loss)
    assert result["grads"].keys() == ref_grads.keys()  # one name for the tied weight, as in the plain model
    for name, expected in ref_grads.items():
        torch.testing.assert_close(result["grads"][name], expected, rtol=1e-10, atol=1e-12, msg=name)


def test_plain_parallelize_module_unties_them_and_the_same_check_fails():
    _, ref_grads = _loss_and_grads(_model())
    result = run_on_ranks(2, _sharded_case, False)[0]
    assert not result["tied"]
    assert not torch.allclose(result["grads"]["embed.weight"], ref_grads["embed.weight"], rtol=1e-6)


def _mismatched_case() -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    plan = {**PLAN, "embed": ColwiseParallel(output_layouts=Replicate())}  # width-split embedding: Shard(1)
    try:
        nd.tensor_parallelize(_model(), mesh, plan)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_plan_that_shards_the_copies_differently_is_refused_naming_both():
    messages = run_on_ranks(2, _mismatched_case)
    assert messages[0] == messages[1]
    assert "tied parameters ['embed.weight', 'head.weight']" in messages[0]
    assert "Shard(dim=1)" in messages[0] and "Shard(dim=0)" in messages[0]


def _check_case(untie_on_rank: int | None) -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = _model()
    ties = nd.tied_parameters(model)
    if untie_on_rank is None:
        parallelize_module(model, mesh, PLAN)
    elif dist.get_rank() == untie_on_rank:  # without a collective, which the other rank would not join
        model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    try:
        nd.check_ties(model, ties)
    except ValueError as error:
        return str(error)
    return "kept"


@pytest.mark.parametrize("untie_on_rank", [None, 1])
def test_check_ties_raises_on_every_rank_naming_the_parameters(untie_on_rank):
    """Also when only one rank untied them: the others must not go on into a collective alone."""
    messages = run_on_ranks(2, _check_case, untie_on_rank)
    assert messages[0] == messages[1], messages
    assert "parameters ['embed.weight', 'head.weight'] were one tensor (tied)" in messages[0]
    assert f"rank {untie_on_rank or 0}:" in messages[0] and "tensor_parallelize" in messages[0]


def test_tied_parameters_names_every_alias():
    assert nd.tied_parameters(_model()) == [("embed.weight", "head.weight")]
    assert nd.tied_parameters(nn.Linear(2, 2)) == []


def test_an_unmatched_plan_key_is_an_error_before_anything_changes():
    with pytest.raises(ValueError, match=r"tp_plan entries \['nope'\] match no submodule of TiedLM"):
        nd.tensor_parallelize(_model(), None, {"nope": ColwiseParallel()})  # type: ignore[arg-type]

