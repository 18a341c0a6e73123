"""Random numbers in ``NDParallelStrategy``'s steps, on 4 CPU ranks, with LightningModules written the usual way:

* dropout on ``dp_shard=2 x tp=2``: the mask on activations replicated over tp is the same on both tp ranks, and
  differs between the data ranks (with one seed on every rank, before the strategy seeded the streams, both data ranks
  drew the same masks for their samples); after ``fit`` the generators are given back (equal on every rank again);
* a diffusion-style step on ``dp_shard=2 x cp=2``: one noise level per clip, the same on the two cp ranks holding its
  halves, and noise per token drawn inside ``strategy.random_streams.fork("cp")``, different on the two halves;
  a module seeding every rank apart (``torch.manual_seed(rank)``, which gave the halves of a clip other noise levels
  and trained on silently) is stopped at the first step on every rank, naming the ranks.

The streams themselves: test_random.py."""

from __future__ import annotations

import lightning as L
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import lightning_ndclip as nd

WIDTH, ROWS, SEQ = 8, 8, 8


def _data() -> torch.Tensor:
    return torch.randn(ROWS, SEQ, WIDTH, generator=torch.Generator().manual_seed(0))


class _Loader(L.LightningModule):
    """Rows ``rank, rank + 2, ...`` of the data rank, in order (both tp / cp peers of a data rank load the same)."""

    def train_dataloader(self):
        data_rank = self.trainer.strategy.meshes["dp"].get_local_rank()
        return torch.utils.data.DataLoader(torch.utils.data.Subset(_data(), range(data_rank, ROWS, 2)), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DropoutMLP(_Loader):
    """A colwise ``up``, a rowwise ``down``, then dropout on the (replicated) output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down, self.drop = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH), nn.Dropout(0.5)
        self.masks: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        out = self.drop(self.down(torch.relu(self.up(batch))))
        self.masks.append((out == 0).detach().clone())
        return out.square().mean()


class Denoiser(_Loader):
    """Diffusion-style, as a video model under cp is trained: the clip's frames cut over cp in the step, one noise
    level per clip, noise per token (in a fork over cp), the velocity ``noise - x`` predicted. ``seed_per_rank``: the
    module seeds every rank apart when training starts, as per-rank seeding is often written."""

    def __init__(self, seed_per_rank: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(WIDTH + 1, WIDTH)
        self.seed_per_rank = seed_per_rank
        self.draws: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_train_start(self) -> None:
        if self.seed_per_rank:
            torch.manual_seed(self.global_rank)

    def training_step(self, batch, batch_idx):
        cp = self.trainer.strategy.meshes["cp"]
        x, _ = nd.shard_sequence(batch, cp.get_local_rank(), cp.size(), dim=1)
        level = torch.rand(x.shape[0], 1, 1)  # per clip: the same on the cp ranks holding its parts
        with self.trainer.strategy.random_streams.fork("cp"):
            noise = torch.randn_like(x)  # per token: this rank's tokens
        self.draws.append((level.flatten(), noise))
        x_t = (1 - level) * x + level * noise
        prediction = self.net(torch.cat([x_t, level.expand(*x.shape[:2], 1)], dim=-1))
        return (prediction - (noise - x)).square().mean()


def _fit(module: L.LightningModule, **sizes: int) -> L.LightningModule:
    use_existing_process_group()
    tp_plan = {"up": ColwiseParallel(), "down": RowwiseParallel()} if "tp" in sizes else None
    strategy = nd.NDParallelStrategy(**sizes, plan=nd.ParallelPlan(tp_plan=tp_plan, fsdp_units=[nn.Linear]), summary=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=2, use_distributed_sampler=False, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    L.seed_everything(0, verbose=False)
    trainer.fit(module)
    return module


def _dropout_case() -> dict:
    module = _fit(DropoutMLP(), dp_shard=2, tp=2)
    return {"masks": module.masks, "after_fit": torch.rand(4)}  # seed_everything(0) before fit, on every rank


def test_dropout_on_tp_replicated_activations_is_alike_on_tp_peers_and_apart_on_data_ranks():
    results = run_on_ranks(4, _dropout_case)  # ranks (0, 1): data rank 0's tp peers; (2, 3): data rank 1's
    masks = [r["masks"] for r in results]
    assert all(torch.equal(r["after_fit"], results[0]["after_fit"]) for r in results)  # generators given back alike
    for step in range(2):
        assert masks[0][step].float().mean() > 0.2  # dropout drew
        assert torch.equal(masks[0][step], masks[1][step]) and torch.equal(masks[2][step], masks[3][step])
        assert not torch.equal(masks[0][step], masks[2][step])  # other samples: other masks


def _denoiser_case(seed_per_rank: bool) -> dict:
    try:
        return {"draws": _fit(Denoiser(seed_per_rank), dp_shard=2, cp=2).draws}
    except ValueError as error:
        return {"error": str(error)}


def test_a_clip_split_over_cp_gets_one_noise_level_and_noise_of_its_own_per_token():
    draws = [r["draws"] for r in run_on_ranks(4, _denoiser_case, False)]  # (0, 1) and (2, 3) hold halves of clips
    for step in range(2):
        (level0, noise0), (level1, noise1), (level2, _) = draws[0][step], draws[1][step], draws[2][step]
        assert torch.equal(level0, level1) and not torch.equal(level0, level2)
        assert not torch.equal(noise0, noise1)  # the clip's two halves: each token its own noise


def test_ranks_seeded_apart_are_stopped_at_the_first_step_naming_them():
    messages = [r.get("error") for r in run_on_ranks(4, _denoiser_case, True)]
    assert len(set(messages)) == 1 and messages[0] is not None, messages  # the same error on every rank
    assert messages[0].startswith("the random streams of ranks holding the same samples differ after the step (data rank 0")
    assert "ranks [[0], [1]]" in messages[0], messages[0]
