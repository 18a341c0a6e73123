"""What the examples share: launch flags, CPU threads per rank and the closing summary."""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_ndclip import GlobalNormClip


def add_launch_args(p: argparse.ArgumentParser, devices: int = 4) -> None:
    """``--accelerator``, ``--devices``, ``--num-nodes``, ``--max-norm`` and ``--logdir``."""
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=devices)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--max-norm", type=float, default=1.0, help="GlobalNormClip's max_norm")
    p.add_argument("--logdir", default="runs", help="TensorBoard root directory")


def share_cpu_threads(accelerator: str, devices: int) -> None:
    """On CPU, give each of the ``devices`` ranks its share of the cores (Lightning's launcher sets
    the thread count on rank 0 only), unless ``OMP_NUM_THREADS`` says otherwise."""
    if accelerator == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))


def print_summary(trainer: L.Trainer, logger: TensorBoardLogger, clip: GlobalNormClip, logdir: str) -> None:
    """On global rank 0: one line summing up the run, ending with where its TensorBoard logs are."""
    if not trainer.is_global_zero:
        return
    m = trainer.callback_metrics
    print(
        f"summary: final loss {float(m['train/loss']):.4f}, last grad norm {float(m['grad_norm/total']):.4f}, "
        f"clip rate {clip.clip_rate:.2f} ({clip.clipped_steps}/{clip.seen_steps} steps clipped), "
        f"skipped steps {clip.skipped_steps}; TensorBoard run: {logger.log_dir} (tensorboard --logdir {logdir})"
    )
