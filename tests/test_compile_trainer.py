"""Compiled transformer blocks under ``NDParallelStrategy``, both ways the how-to gives: ``ParallelPlan(compile=...)``
(the strategy compiles each ``fsdp_units`` block once it applied the plan, in ``setup``) and ``block.compile(...)``
in a ``configure_model`` of one's own, after parallelizing. The first training step runs under the split-activation
watch, eagerly; the next ones compiled, with no graph break, and every step's loss and the trained weights equal
the uncompiled run's (float64, ``aot_eager``)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from harness import run_on_ranks
from helpers import use_existing_process_group
from test_compile import BACKEND, TP_PLAN, Block, Net
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import lightning_ndclip as nd
from lightning_ndclip import _compat

STEPS = 3


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net().double()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x).flatten(0, 1), y.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(2 * STEPS, 3, 3, generator=g, dtype=torch.float64), torch.randint(0, 5, (2 * STEPS, 3), generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)


class OwnParallelization(Model):
    def configure_model(self) -> None:
        tp, fsdp = self.trainer.strategy.meshes["tp"], self.trainer.strategy.meshes["fsdp"]
        nd.tensor_parallelize(self.net, tp, TP_PLAN)
        for block in self.net.blocks:
            fully_shard(block, mesh=fsdp)
            block.compile(fullgraph=True, **BACKEND)  # after parallelizing it
        fully_shard(self.net, mesh=fsdp)


def _fit(how: str) -> dict[str, Any]:
    use_existing_process_group()
    compile = BACKEND if how == "plan" else False
    tp_plan = {f"net.{key}": style for key, style in TP_PLAN.items()}  # names relative to the LightningModule
    plan = nd.ParallelPlan(tp_plan=tp_plan, fsdp_units=[Block], compile=compile) if how != "configure_model" else None
    model = OwnParallelization() if how == "configure_model" else Model()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=nd.NDParallelStrategy(tp=2, plan=plan, summary=False), max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    counters = _compat.dynamo_counters()
    return {
        "losses": model.losses,
        "weights": weights,
        "breaks": dict(counters["graph_break"]),
        "graphs": counters["stats"]["unique_graphs"],  # so far
    }


def _runs() -> dict[str, dict[str, Any]]:
    """The uncompiled run, then the two compiled ones, Dynamo's counts since the first (the second may reuse the
    graph the first compiled: one block's code either way)."""
    torch.compiler.reset()
    _compat.dynamo_counters().clear()
    return {how: _fit(how) for how in ("eager", "plan", "configure_model")}


def test_blocks_compiled_by_the_plan_or_in_configure_model_train_as_uncompiled_with_no_graph_break():
    for runs in run_on_ranks(2, _runs, retire_pool=True):
        eager = runs.pop("eager")
        assert eager["graphs"] == 0 and len(eager["losses"]) == STEPS
        for how, run in runs.items():
            assert run["breaks"] == {}, how
            assert run["graphs"] >= 1, how
            assert torch.allclose(torch.tensor(run["losses"]), torch.tensor(eager["losses"]), rtol=0, atol=1e-12), how
            assert all(torch.allclose(run["weights"][n], w, rtol=0, atol=1e-12) for n, w in eager["weights"].items()), how
