"""Train a tiny video diffusion transformer with NDParallelStrategy (FSDP2 x context parallel), the
exact per-sample mean loss, GlobalNormClip(1.0) and TensorBoard, on video latents it generates itself.

    python examples/train_video_dit.py                         # 4 CPU ranks: dp_shard=2 x cp=2, ~30 s on 2 cores
    python examples/train_video_dit.py --devices 2 --cp 2      # context parallel only
    python examples/train_video_dit.py --devices 1 --cp 1 --batch-size 8   # one device: the same losses and norms
    python examples/train_video_dit.py --accelerator gpu --devices 8 --cp 4 --width 512 --layers 8
    torchrun --nproc-per-node 4 examples/train_video_dit.py    # or under SLURM: srun python ...

The data: clips of 1 to ``--max-frames`` frames of moving sine waves on a ``--grid`` x ``--grid``
latent grid, cut into patches (one token per patch and frame) and packed into rows of ``--seq-len``
tokens, padding at the end of some rows. Clips of different lengths share a row and each attends
only to itself (bidirectional attention within a packed sample). The model learns rectified-flow
denoising: from ``x_t = (1 - t) x_0 + t noise`` and ``t`` it predicts ``noise - x_0``.

Context parallel: the ranks of a ``cp`` group hold the same rows and each a part of every row
(``shard_sequence``); ``context_parallel_attention`` passes keys and values round the group (ring
attention), so a clip split between ranks still attends to all of itself. The loss is the mean over clips of each
clip's mean token loss (``loss_normalization="sample_mean"``), exact although a clip's tokens are
spread over cp ranks, and clips over dp ranks and accumulated micro-batches.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import add_launch_args, print_summary, share_cpu_threads  # examples/_common.py
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ndclip import GlobalNormClip, NDParallelStrategy, ParallelPlan
from lightning_ndclip.core.context.attention import context_parallel_attention, shard_sequence

TIME_FEATURES = 32


def moving_waves(frames: int, grid: int, channels: int, g: torch.Generator) -> torch.Tensor:
    """One clip of latents ``[frames, grid, grid, channels]``: a sine wave per channel, drifting."""
    wave = torch.randn(channels, 2, generator=g)  # wave vector (rows, columns) per channel
    velocity = torch.randn(2, generator=g)
    phase = torch.rand(channels, generator=g) * 2 * math.pi
    f, y, x = torch.meshgrid(torch.arange(frames), torch.arange(grid), torch.arange(grid), indexing="ij")
    y, x = y - velocity[0] * f, x - velocity[1] * f
    return torch.sin(wave[:, 0] * y[..., None] + wave[:, 1] * x[..., None] + phase)


def patchify(clip: torch.Tensor, patch: int) -> torch.Tensor:
    """``[frames, grid, grid, c]`` -> ``[frames x (grid/patch)^2, patch x patch x c]`` tokens."""
    f, grid, _, c = clip.shape
    n = grid // patch
    return clip.view(f, n, patch, n, patch, c).permute(0, 1, 3, 2, 4, 5).reshape(f * n * n, patch * patch * c)


def packed_video_latents(args: argparse.Namespace, seed: int = 0) -> TensorDataset:
    """Rows of packed noisy clips: ``(x_t, target, t, frame, patch, sample_ids)``, each
    ``[rows, seq_len, ...]``. ``sample_ids`` number the clips of a row ``0, 1, ...``; padding
    tokens have id -1 and zeros elsewhere."""
    g = torch.Generator().manual_seed(seed)
    per_frame = (args.grid // args.patch) ** 2
    dim = args.patch**2 * args.channels
    rows, seq = args.rows, args.seq_len
    x_t, target = torch.zeros(rows, seq, dim), torch.zeros(rows, seq, dim)
    t = torch.zeros(rows, seq)
    frame, patch = torch.zeros(rows, seq, dtype=torch.long), torch.zeros(rows, seq, dtype=torch.long)
    ids = torch.full((rows, seq), -1)
    for r in range(rows):
        start, clip_id = 0, 0
        while seq - start >= per_frame:  # pack clips; after each, stop with probability 1/4 (padding)
            frames = int(torch.randint(1, min(args.max_frames, (seq - start) // per_frame) + 1, (1,), generator=g))
            x0 = patchify(moving_waves(frames, args.grid, args.channels, g), args.patch)
            noise, level = torch.randn(x0.shape, generator=g), float(torch.rand((), generator=g))
            end = start + len(x0)
            x_t[r, start:end], target[r, start:end] = (1 - level) * x0 + level * noise, noise - x0
            t[r, start:end], ids[r, start:end] = level, clip_id
            frame[r, start:end] = torch.arange(frames).repeat_interleave(per_frame)
            patch[r, start:end] = torch.arange(per_frame).repeat(frames)
            start, clip_id = end, clip_id + 1
            if float(torch.rand((), generator=g)) < 0.25:
                break
    return TensorDataset(x_t, target, t, frame, patch, ids)


def timestep_features(t: torch.Tensor) -> torch.Tensor:
    """Sinusoidal features of the noise level ``t`` in [0, 1]: ``[..., TIME_FEATURES]``."""
    freqs = torch.exp(-math.log(1000.0) * torch.arange(TIME_FEATURES // 2, device=t.device) / (TIME_FEATURES // 2))
    angles = 1000.0 * t[..., None] * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class DiTBlock(nn.Module):
    """Attention and MLP, each modulated by the noise level (adaLN-Zero: the block starts as identity)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.modulation = nn.Linear(width, 6 * width)
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)

    def forward(
        self, h: torch.Tensor, cond: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor, group: dist.ProcessGroup
    ) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(F.silu(cond)).chunk(6, dim=-1)
        b, s, w = h.shape
        a = self.norm1(h) * (1 + scale1) + shift1
        q, k, v = self.qkv(a).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        # this rank's queries against the keys of the whole row, gathered over cp, within each clip
        a = context_parallel_attention(q, k, v, group=group, positions=positions, sample_ids=ids)
        h = h + gate1 * self.proj(a.transpose(1, 2).reshape(b, s, w))
        m = self.norm2(h) * (1 + scale2) + shift2
        return h + gate2 * self.fc2(F.gelu(self.fc1(m)))


class VideoDiT(nn.Module):
    """Patch projection + frame and patch position embeddings + noise-level embedding, blocks, head."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        dim, width = args.patch**2 * args.channels, args.width
        self.patch_embed = nn.Linear(dim, width)
        self.frame_embed = nn.Embedding(args.max_frames, width)
        self.patch_pos = nn.Embedding((args.grid // args.patch) ** 2, width)
        self.time_embed = nn.Sequential(nn.Linear(TIME_FEATURES, width), nn.SiLU(), nn.Linear(width, width))
        self.blocks = nn.ModuleList(DiTBlock(width, args.heads) for _ in range(args.layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, dim)

    def forward(
        self,
        x_t: torch.Tensor,
        t: torch.Tensor,
        frame: torch.Tensor,
        patch: torch.Tensor,
        positions: torch.Tensor,
        ids: torch.Tensor,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        cond = self.time_embed(timestep_features(t))
        h = self.patch_embed(x_t) + self.frame_embed(frame) + self.patch_pos(patch)
        for block in self.blocks:
            h = block(h, cond, positions, ids, group)
        # the head's bias added apart: nn.Linear with a bias returns a view for a 3-D input, and FSDP2
        # warns when a unit returns a view (an in-place op on it would skip the unit's backward hooks)
        return F.linear(self.norm(h), self.head.weight) + self.head.bias


def cp_forward(
    model: VideoDiT, batch: list[torch.Tensor], rank: int, size: int, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This cp rank's part of every row of ``batch`` through ``model``: ``(prediction, target)``."""
    parts = [shard_sequence(tensor, rank, size) for tensor in batch]  # this rank's part of each row
    x_t, target, t, frame, patch, ids = (local for local, _ in parts)
    positions = parts[0][1]
    return model(x_t, t, frame, patch, positions, ids, group), target


class LitVideoDiT(L.LightningModule):
    """The per-token denoising loss; the strategy turns it into the exact per-clip mean."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.model = VideoDiT(args)

    def _cp(self) -> tuple[int, int, dist.ProcessGroup]:
        cp = self.trainer.strategy.meshes["cp"]
        return cp.get_local_rank(), cp.size(), cp.get_group()

    def sample_ids(self, batch: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
        """The strategy's hook: this cp rank's per-token clip ids, numbered over the whole
        micro-batch (alike on the ranks of a cp group), and the number of clips."""
        ids = batch[-1]
        clips_per_row = ids.max(dim=1).values + 1
        first = clips_per_row.cumsum(0) - clips_per_row
        numbered = torch.where(ids >= 0, ids + first[:, None], -1)
        rank, size, _ = self._cp()
        return shard_sequence(numbered, rank, size)[0], int(clips_per_row.sum())

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        prediction, target = cp_forward(self.model, batch, *self._cp())
        return F.mse_loss(prediction, target, reduction="none").mean(-1)  # per token: the strategy weighs them

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.args.lr, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(packed_video_latents(self.args), batch_size=self.args.batch_size, shuffle=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_launch_args(p)
    p.add_argument("--dp-shard", type=int, default=-1)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--grid", type=int, default=8, help="latent height and width")
    p.add_argument("--channels", type=int, default=4)
    p.add_argument("--patch", type=int, default=2)
    p.add_argument("--max-frames", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every-n-steps", type=int, default=5)
    return p.parse_args(argv)


def strategy_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """NDParallelStrategy's arguments: the mesh sizes and the declarative plan that parallelizes ``LitVideoDiT``."""
    return dict(dp_shard=args.dp_shard, cp=args.cp, plan=ParallelPlan(fsdp_units=(DiTBlock,)), loss_normalization="sample_mean",
                log_loss="train/loss")


def main(argv: list[str] | None = None) -> None:
    """Train as the command line ``argv`` (default: ``sys.argv[1:]``) says."""
    args = parse_args(argv)
    share_cpu_threads(args.accelerator, args.devices)

    strategy = NDParallelStrategy(**strategy_kwargs(args))
    clip = GlobalNormClip(args.max_norm, log_module_depth=2)  # grad_norm/model.blocks, model.head, ...
    logger = TensorBoardLogger(args.logdir, name="video_dit")
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
        callbacks=[clip], logger=logger, max_steps=args.max_steps, accumulate_grad_batches=args.accumulate,
        log_every_n_steps=args.log_every_n_steps, enable_checkpointing=False, enable_model_summary=False,
    )
    L.seed_everything(0, verbose=False)  # the same initial weights on every rank and for every layout
    trainer.fit(LitVideoDiT(args))
    print_summary(trainer, logger, clip, args.logdir)


if __name__ == "__main__":
    main()
