"""NDParallelStrategy + GlobalNormClip + TensorBoard on CPU ranks, launched by Lightning itself.

A small MLP on generated data, parallelized declaratively (FSDP2 units, tensor parallel when
``--tp 2``), clipped to an exact global norm, logged to TensorBoard.

    python examples/lightning_quickstart.py                      # 2 CPU processes, FSDP2
    python examples/lightning_quickstart.py --devices 4 --tp 2   # FSDP2 x tensor parallel
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_ndclip import GlobalNormClip, NDParallelStrategy, ParallelPlan


class Regressor(L.LightningModule):
    """No parallel code: the strategy's plan parallelizes it."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, 16), nn.GELU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 16, generator=g)
        y = (x[:, :4].sum(1, keepdim=True) ** 2) / 4 + 0.1 * torch.randn(4096, 1, generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--logdir", default="runs")
    return parser.parse_args(argv)


def strategy_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """NDParallelStrategy's arguments: the declarative plan that parallelizes ``Regressor``."""
    if args.tp == 1:  # one FSDP2 unit per linear, and the root
        return dict(tp=1, plan=ParallelPlan(fsdp_units=(nn.Linear,)))
    # the TP linears stay in the root unit: their outputs are views (DTensor.to_local), and FSDP2
    # warns when a unit returns a view (an in-place op on it would skip the unit's backward hooks)
    return dict(tp=args.tp, plan=ParallelPlan(tp_plan={"net.0": ColwiseParallel(), "net.2": RowwiseParallel()}))


def main() -> None:
    args = parse_args()
    if "OMP_NUM_THREADS" not in os.environ:  # Lightning sets it on rank 0 only
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))  # the ranks share the cores

    clip = GlobalNormClip(args.max_norm, log_module_depth=2)
    logger = TensorBoardLogger(args.logdir, name="quickstart")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=NDParallelStrategy(**strategy_kwargs(args)),
        callbacks=[clip],
        logger=logger,
        max_steps=args.max_steps,
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    L.seed_everything(0, verbose=False)  # reproducible: the same initial weights on every rank
    trainer.fit(Regressor())
    metrics = trainer.callback_metrics
    if trainer.is_global_zero:
        print(
            f"summary: final loss {float(metrics['train/loss']):.4f}, last grad norm "
            f"{float(metrics['grad_norm/total']):.4f}, clip rate {clip.clip_rate:.2f} "
            f"({clip.clipped_steps}/{clip.seen_steps} steps clipped), skipped steps {clip.skipped_steps}; "
            f"TensorBoard run: {logger.log_dir} (tensorboard --logdir {args.logdir})"
        )


if __name__ == "__main__":
    main()
