"""Pipeline stages and schedules: gradients and the global norm equal a single device (float64),
with the loss normalized by the global valid-token count and no division by the schedule. The same
in ``Trainer.fit`` (``NDParallelStrategy(pp=2, ...)``): test_pipeline_trainer.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from test_norm_dtensor import assert_close
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import lightning_ndclip as nd
from lightning_ndclip.core.experts import MoE, shard_experts
from lightning_ndclip.core.pipeline import build_pipeline, model_units, split_model, sync_tied_parameters, tie_gradients

VOCAB, WIDTH = 11, 8


class TinyLM(nn.Module):
    def __init__(self, layers: int = 4, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleDict({str(i): nn.Linear(WIDTH, WIDTH) for i in range(layers)})
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) if self.embed is not None else tokens
        for layer in self.layers.values():
            h = torch.tanh(layer(h))
        return self.head(h) if self.head is not None else h


def _batch():
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (8, 6), generator=g)
    labels = torch.randint(0, VOCAB, (8, 6), generator=g)
    labels[torch.rand(8, 6, generator=g) < 0.3] = -100  # micro-batches with different token counts
    return tokens, labels


def _reference(tied: bool, layers: int = 4):
    model = TinyLM(layers, tied)
    tokens, labels = _batch()
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    (loss / (labels != -100).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    unique = [p.grad for p in model.parameters()]  # a tied weight once
    return grads, torch.linalg.vector_norm(torch.cat([g.flatten() for g in unique]))


def _pp_case(schedule: str, stages_per_rank: int, tied: bool, layers: int = 4) -> float:
    ref_grads, ref_norm = _reference(tied, layers)
    pp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    tokens, labels = _batch()
    # the global count covers every micro-batch (no dp here); pp peers see the same batch, so pp is
    # never part of the group a count is summed over
    count = nd.count_valid_tokens(labels)

    def loss_fn(out, target):
        loss_sum = nn.functional.cross_entropy(out.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
        return loss_sum / count
    num_stages = dist.get_world_size() * stages_per_rank
    units = model_units(TinyLM(layers, tied))
    cut = [units[round(i * len(units) / num_stages)] for i in range(1, num_stages)]
    sched, modules = build_pipeline(
        TinyLM(layers, tied), pp_mesh, cut, n_microbatches=4, loss_fn=loss_fn, schedule=schedule,
        stages_per_rank=stages_per_rank,
    )
    rank, last = pp_mesh.get_local_rank(), dist.get_world_size() - 1
    if rank == 0:
        sched.step(tokens, target=labels if rank == last else None)
    elif rank == last:
        sched.step(target=labels)
    else:
        sched.step()
    tied_params = {}
    if tied:  # the first stage's embedding and the last stage's head are one parameter
        holders = [m.embed.weight for m in modules if m.embed is not None]
        holders += [m.head.weight for m in modules if m.head is not None]
        tie_gradients(holders, pp_mesh.get_group())
        tied_params = {"embed.weight": holders[0]}
    params = [p for m in modules for p in m.parameters()]
    total = nd.clip_grad_norm_(params, 1e9, pp_mesh=pp_mesh, tied_parameters=tied_params)
    assert_close(total, ref_norm)
    if tied:  # without the declaration the tied weight counts once per stage
        untied = nd.get_total_norm([p.grad for p in params], pp_mesh=pp_mesh)
        assert float(untied) > float(ref_norm) * (1 + 1e-6)
        # per-tensor norms: every stage's tensors on every rank, the tied weight once (under its first stage's name)
        named = [(n, p) for m in modules for n, p in m.named_parameters()]
        per_tensor = nd.grad_norms(named, pp_mesh=pp_mesh, tied_parameters=tied_params).as_dict()
        assert sorted(per_tensor) == sorted(n for n in ref_grads if n != "head.weight")
        for name, value in per_tensor.items():
            assert_close(value, ref_grads[name].norm())
    worst = 0.0
    for m in modules:
        for name, p in m.named_parameters():
            worst = max(worst, float((p.grad - ref_grads[name]).norm() / ref_grads[name].norm()))
    return worst


@pytest.mark.parametrize(
    "schedule,stages_per_rank", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)],
    ids=["gpipe", "1f1b", "interleaved-2-per-rank"],
)
def test_pipeline_gradients_and_norm_match_single_device(schedule, stages_per_rank):
    assert max(run_on_ranks(2, _pp_case, schedule, stages_per_rank, False)) < 1e-10


def test_tied_embedding_across_first_and_last_stage_counts_once():
    assert max(run_on_ranks(2, _pp_case, "1f1b", 1, True)) < 1e-10


def test_split_points_are_checked():
    model = TinyLM()
    assert model_units(model) == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    stage = split_model(model, ["layers.2", "layers.3", "head"])
    assert stage.embed is None and list(stage.layers) == ["2", "3"]
    from lightning_ndclip.core.pipeline import stage_units_of as _stage_units

    with pytest.raises(ValueError, match="not a unit"):
        _stage_units(model_units(model), ["layers.9"], 2)
    with pytest.raises(ValueError, match="3 stages need 2 split points"):
        _stage_units(model_units(model), ["layers.2"], 3)


def _pp_dp_tp_case(schedule: str) -> float:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    ref_grads, ref_norm = _reference(False)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp_shard", "tp"))
    tokens, labels = _batch()
    dp = mesh["dp_shard"].get_local_rank()
    tokens, labels = tokens.chunk(2)[dp], labels.chunk(2)[dp]
    count = nd.sync_token_count(nd.count_valid_tokens(labels), group=mesh["dp_shard"].get_group())

    def loss_fn(out, target):
        return count.normalize(
            nn.functional.cross_entropy(out.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
        )

    def parallelize(stage: nn.Module) -> None:
        first = sorted(stage.layers)[0]
        pair = {f"layers.{first}": ColwiseParallel(), f"layers.{int(first) + 1}": RowwiseParallel()}
        parallelize_module(stage, mesh["tp"], pair)
        for layer in stage.layers.values():
            fully_shard(layer, mesh=mesh["dp_shard"])
        fully_shard(stage, mesh=mesh["dp_shard"])
        nd.use_sum_reduction(stage)

    sched, modules = build_pipeline(
        TinyLM(), mesh["pp"], ["layers.2"], n_microbatches=2, loss_fn=loss_fn, schedule=schedule,
        parallelize_fn=parallelize,
    )
    if mesh["pp"].get_local_rank() == 0:
        sched.step(tokens)
    else:
        sched.step(target=labels)
    params = [p for m in modules for p in m.parameters()]
    assert_close(nd.clip_grad_norm_(params, 1e9), ref_norm)  # pp inferred from the "pp" mesh dim
    return max(
        float((p.grad.full_tensor() - ref_grads[n]).norm() / ref_grads[n].norm())
        for m in modules
        for n, p in m.named_parameters()
    )


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pp2_dp2_tp2_on_eight_ranks_matches_single_device(schedule):
    assert max(run_on_ranks(8, _pp_dp_tp_case, schedule)) < 1e-10


# --- a MoE layer inside one pipeline stage, experts sharded over that stage's data ranks ---


class _MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = MoE(WIDTH, 12, num_experts=4, top_k=2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(h)


def _moe_lm() -> TinyLM:
    model = TinyLM()
    torch.manual_seed(1)
    model.layers["1"] = _MoEBlock().double()
    return model


def _moe_reference():
    model = _moe_lm()
    tokens, labels = _batch()
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    (loss / (labels != -100).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads.values()]))


def _pp_moe_case() -> dict:
    from torch.distributed.fsdp import fully_shard

    ref_grads, ref_norm = _moe_reference()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    experts_mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "edp", "ep"))
    dp = mesh["dp_shard"]
    tokens, labels = (t.chunk(2)[dp.get_local_rank()] for t in _batch())
    count = nd.sync_token_count(nd.count_valid_tokens(labels), group=dp.get_group())

    def loss_fn(out, target):
        return count.normalize(
            nn.functional.cross_entropy(out.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
        )

    def parallelize(stage: nn.Module) -> None:  # stage 0 holds the MoE layer, stage 1 none
        for layer in stage.layers.values():
            if isinstance(layer, _MoEBlock):  # ep = the stage's 2 data ranks; expert-dp of size 1
                shard_experts(layer.moe, experts_mesh["ep"])
                fully_shard(layer.moe.experts, mesh=experts_mesh["edp"])
                fully_shard(layer, mesh=dp)  # the router
            else:
                fully_shard(layer, mesh=dp)
        fully_shard(stage, mesh=dp)
        nd.use_sum_reduction(stage)

    sched, modules = build_pipeline(
        _moe_lm(), mesh["pp"], ["layers.2"], n_microbatches=2, loss_fn=loss_fn, schedule="1f1b",
        parallelize_fn=parallelize,
    )
    if mesh["pp"].get_local_rank() == 0:
        sched.step(tokens)
    else:
        sched.step(target=labels)
    (stage,) = modules
    norms = nd.grad_norms(stage)  # pp inferred from the "pp" dim of the root mesh
    return {
        "total": float(norms.total),
        "ref_total": float(ref_norm),
        "per_tensor": {n: float(v) for n, v in norms.as_dict().items()},
        "ref_per_tensor": {n: float(g.norm()) for n, g in ref_grads.items()},
        "grad_err": max(
            float((p.grad.full_tensor() - ref_grads[n]).norm() / ref_grads[n].norm()) for n, p in stage.named_parameters()
        ),
        "experts_here": sorted(n for n, _ in stage.named_parameters() if "experts" in n),
    }


def test_moe_in_one_pipeline_stage_matches_single_device():
    results = run_on_ranks(4, _pp_moe_case)
    assert [r["experts_here"] for r in results][::2] == [["layers.1.moe.experts.w_in", "layers.1.moe.experts.w_out"], []]
    for r in results:
        assert r["grad_err"] < 1e-10
        assert abs(r["total"] - r["ref_total"]) <= 1e-12 * r["ref_total"]
        assert r["per_tensor"].keys() == r["ref_per_tensor"].keys()  # every stage's tensors, on every rank
        for name, value in r["per_tensor"].items():
            assert abs(value - r["ref_per_tensor"][name]) <= 1e-12 * r["ref_per_tensor"][name], name


def _sync_tied_case() -> list[float]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    torch.manual_seed(dist.get_rank())  # the two stages' copies start different
    copy = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    sync_tied_parameters([copy], mesh.get_group())
    return copy.detach().reshape(-1).tolist()


def test_tied_copies_start_from_the_lowest_stage():
    first, second = run_on_ranks(2, _sync_tied_case)
    torch.manual_seed(0)
    assert first == second == torch.randn(4, 3, dtype=torch.float64).reshape(-1).tolist()


def test_a_plan_for_the_whole_model_gives_each_stage_the_entries_naming_its_modules():
    """``ParallelPlan.for_stage``: the tp entries, unit classes and loss-parallel head a stage holds; an entry naming
    nothing in the whole model is still an error (checked on the model, before any stage exists)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = TinyLM()
    tp_plan = {"layers.0": ColwiseParallel(), "layers.3": RowwiseParallel(), "head": ColwiseParallel(output_layouts=Replicate())}
    plan = nd.ParallelPlan(tp_plan=tp_plan, fsdp_units=[nn.Embedding, nn.Linear], loss_parallel=True)
    first, last = split_model(model, ["embed", "layers.0", "layers.1"]), split_model(model, ["layers.2", "layers.3", "head"])
    assert plan.for_stage(model, first) == nd.ParallelPlan(
        tp_plan={"layers.0": tp_plan["layers.0"]}, fsdp_units=[nn.Embedding, nn.Linear], loss_parallel=False
    )
    assert plan.for_stage(model, last) == nd.ParallelPlan(
        tp_plan={"layers.3": tp_plan["layers.3"], "head": tp_plan["head"]}, fsdp_units=[nn.Linear], loss_parallel="head"
    )
    with pytest.raises(ValueError, match=r"tp_plan entries \['lm_head'\] match no submodule of TinyLM"):
        nd.ParallelPlan(tp_plan={"lm_head": ColwiseParallel()}).for_stage(model, first)
    with pytest.raises(ValueError, match=r"fsdp_units: \['LayerNorm'\] match no submodule of TinyLM"):
        nd.ParallelPlan(fsdp_units=[nn.LayerNorm]).for_stage(model, first)
