"""Fine-tune a diffusers video model with NDParallelStrategy: context parallelism where the model's own plan says
(``tp_plan="auto"``), FSDP2 over its blocks, the exact per-clip mean, GlobalNormClip(1.0) and TensorBoard.

    python examples/finetune_diffusers.py                            # a tiny Wan, 4 CPU ranks: dp_shard=2 x cp=2
    python examples/finetune_diffusers.py --dp-shard 1 --cp 4        # each clip cut over 4 ranks
    python examples/finetune_diffusers.py --verify                   # the first step checked against one process
    python examples/finetune_diffusers.py --model path/to/transformer --accelerator gpu --devices 8 --cp 4
    torchrun --nproc-per-node 4 examples/finetune_diffusers.py       # or under SLURM: srun python ...

``--model`` is a local ``WanTransformer3DModel`` directory (``config.json`` and ``diffusion_pytorch_model*.safetensors``,
as ``save_pretrained`` writes them; a pipeline's ``transformer/`` folder): the model is built on the meta device and
the strategy loads the checkpoint straight into each rank's shards (``hf_checkpoint=``). Without it a tiny random
Wan is built offline. The data: latent clips of
moving sine waves, ``--frames`` latent frames of which each clip keeps 1 to all (the rest masked out of its loss),
with a random prompt embedding each. The loss is flow matching (the velocity from the clip to the noise), per
latent element; ``loss_normalization="sample_mean"`` makes it each clip's mean over its own elements, then the
mean over the clips of the global batch, however the cut spreads a clip's tokens over the cp ranks. The noise and
the noise level are drawn in the step: alike on a clip's cp peers, apart on the data ranks (the strategy's
random streams).
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
from _common import add_launch_args, print_summary, share_cpu_threads  # examples/_common.py
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader
from train_video_dit import moving_waves  # examples/train_video_dit.py: latents of drifting waves

from lightning_ndclip import GlobalNormClip, NDParallelStrategy, ParallelPlan, VerifyOneDevice


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The checkpoint's Wan transformer on the meta device (the strategy fills it), or a tiny random one."""
    from diffusers import WanTransformer3DModel

    if args.model:
        with torch.device("meta"):
            return WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(args.model))
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=args.channels,
        out_channels=args.channels, text_dim=args.text_dim, freq_dim=32, ffn_dim=64, num_layers=args.layers,
        cross_attn_norm=True, rope_max_seq_len=64,
    )  # fmt: skip


def latent_clips(args: argparse.Namespace, channels: int, text_dim: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``--rows`` clips: latents ``[channels, frames, grid, grid]``, the mask of the frames each keeps, a prompt."""
    g = torch.Generator().manual_seed(seed)
    clips = []
    for _ in range(args.rows):
        latents = moving_waves(args.frames, args.grid, channels, g).permute(3, 0, 1, 2).contiguous()
        kept = int(torch.randint(1, args.frames + 1, (), generator=g))
        mask = torch.zeros(latents.shape, dtype=torch.bool)
        mask[:, :kept] = True
        clips.append({"latents": latents, "mask": mask, "text": torch.randn(args.prompt_len, text_dim, generator=g)})
    return clips


class FineTune(L.LightningModule):
    """Flow matching per latent element; the strategy makes it the exact mean over clips of each clip's mean."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.model = build_model(args)

    def sample_ids(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """Each element's clip (its row of the batch), -1 where masked; the number of clips."""
        mask = batch["mask"].flatten(1)
        rows = torch.arange(mask.shape[0], device=mask.device).view(-1, 1).expand_as(mask)
        return torch.where(mask, rows, -1), mask.shape[0]

    def training_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        latents = batch["latents"]
        noise = torch.randn_like(latents)
        level = torch.rand(latents.shape[0], device=latents.device, dtype=latents.dtype)
        s = level.view(-1, 1, 1, 1, 1)
        noisy = (1 - s) * latents + s * noise
        velocity = self.model(hidden_states=noisy, timestep=level * 1000, encoder_hidden_states=batch["text"]).sample
        return ((velocity - (noise - latents)) ** 2).flatten(1)  # [clips, elements]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.args.lr, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader:
        config = self.model.config
        clips = latent_clips(self.args, config.in_channels, config.text_dim)
        return DataLoader(clips, batch_size=self.args.batch_size, shuffle=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_launch_args(p)
    p.add_argument("--model", default=None, help="a local WanTransformer3DModel directory (default: a tiny random one)")
    p.add_argument("--dp-shard", type=int, default=-1)
    p.add_argument("--cp", type=int, default=2, help="context parallel: each clip's latent tokens cut over cp ranks")
    p.add_argument("--channels", type=int, default=4)
    p.add_argument("--text-dim", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--frames", type=int, default=4, help="latent frames per clip (each keeps 1 to all of them)")
    p.add_argument("--grid", type=int, default=8, help="latent height and width (patches of 2 x 2)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--verify", action="store_true", help="check the first step against the model on one process")
    p.add_argument("--log-every-n-steps", type=int, default=5)
    return p.parse_args(argv)


def strategy_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    plan = ParallelPlan(tp_plan="auto")  # the model's own _cp_plan under cp; FSDP2 units: its blocks
    return dict(dp_shard=args.dp_shard, cp=args.cp, plan=plan, loss_normalization="sample_mean", log_loss="train/loss",
                hf_checkpoint=args.model)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Train as the command line ``argv`` (default: ``sys.argv[1:]``) says."""
    args = parse_args(argv)
    share_cpu_threads(args.accelerator, args.devices)
    L.seed_everything(0, verbose=False)  # the same initial weights on every rank and for every layout
    module = FineTune(args)
    clip = GlobalNormClip(args.max_norm)
    logger = TensorBoardLogger(args.logdir, name="finetune_diffusers")
    callbacks = [VerifyOneDevice(), clip] if args.verify else [clip]  # the check sees the gradients before the clip
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
        strategy=NDParallelStrategy(**strategy_kwargs(args)), callbacks=callbacks, logger=logger,
        max_steps=args.max_steps, accumulate_grad_batches=args.accumulate, log_every_n_steps=args.log_every_n_steps,
        enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    print_summary(trainer, logger, clip, args.logdir)


if __name__ == "__main__":
    main()
