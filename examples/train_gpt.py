"""Train a small GPT with NDParallelStrategy (FSDP2 x tensor parallel, optional pipeline), the exact
global token mean, GlobalNormClip(1.0) and TensorBoard, on packed documents it generates itself.

    python examples/train_gpt.py                          # 4 CPU ranks: dp_shard=2 x tp=2, ~35 s on 2 cores
    python examples/train_gpt.py --devices 4 --tp 1 --pp 2 --dp-shard 2    # pipeline x FSDP2
    python examples/train_gpt.py --accelerator gpu --devices 8 --tp 2 --width 512 --layers 8
    torchrun --nproc-per-node 4 examples/train_gpt.py     # or under SLURM: srun python ...

The data: documents of random length drawn from a small random Markov chain, packed into rows
of ``--seq-len`` tokens, padding labelled -100, so ranks hold different numbers of valid tokens
(which is when per-rank loss averaging goes wrong and the global token mean matters).
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from _common import add_launch_args, print_summary, share_cpu_threads  # examples/_common.py
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_ndclip import GlobalNormClip, NDParallelStrategy, ParallelPlan, PipelineOptions, VerifyOneDevice


def packed_documents(rows: int, seq_len: int, vocab: int, seed: int = 0) -> TensorDataset:
    """Rows packed with Markov-chain documents; each row ends with 0..seq_len/4 padding tokens."""
    g = torch.Generator().manual_seed(seed)
    transition = torch.softmax(torch.randn(vocab, vocab, generator=g) * 3, dim=-1)
    tokens = torch.zeros(rows, seq_len + 1, dtype=torch.long)
    labels = torch.full((rows, seq_len), -100)
    for r in range(rows):
        used = seq_len + 1 - int(torch.randint(0, seq_len // 4 + 1, (1,), generator=g))
        t = int(torch.randint(vocab, (1,), generator=g))
        for i in range(used):
            tokens[r, i] = t
            t = int(torch.multinomial(transition[t], 1, generator=g))
        labels[r, : used - 1] = tokens[r, 1:used]
    return TensorDataset(tokens[:, :-1], labels)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        # the fused rows are head-major (q, k, v of head 0, then of head 1, ...), so the contiguous row
        # block ColwiseParallel gives each TP rank holds whole heads' q, k and v: -1 is the local head count
        qkv = self.qkv(self.norm1(h))
        q, k, v = qkv.view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        return h + self.fc2(F.gelu(self.fc1(self.norm2(h))))


class GPT(nn.Module):
    """Embedding, blocks in a ModuleDict (so pipeline stages can be cut between them), head."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(seq_len, width) * 0.02)
        self.layers = nn.ModuleDict({str(i): Block(width, heads) for i in range(layers)})
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]] if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.head(self.norm(h)) if self.head is not None else h


class LitGPT(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.model = GPT(args.vocab, args.width, args.layers, args.heads, args.seq_len)

    def count_tokens(self, batch) -> torch.Tensor:  # the strategy's global token count
        return (batch[1] != -100).sum()

    def pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # per-token losses: a pipeline micro-batch's mean could not be weighted by its token count
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")

    def training_step(self, batch):
        tokens, labels = batch
        if self.args.pp > 1:  # the schedule runs forward and backward of every micro-batch
            return self.trainer.strategy.run_pipeline(tokens, labels)
        # the mean, as usual: the strategy weighs it by this micro-batch's tokens over the window's
        # global count, and logs the exact window mean as train/loss
        return F.cross_entropy(self.model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.args.lr, weight_decay=0.01)

    def train_dataloader(self):
        data = packed_documents(self.args.rows, self.args.seq_len, self.args.vocab)
        return DataLoader(data, batch_size=self.args.batch_size, shuffle=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_launch_args(p)
    p.add_argument("--dp-shard", type=int, default=-1)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--verify", action="store_true", help="check the first step against the model on one process")
    return p.parse_args(argv)


def strategy_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """NDParallelStrategy's arguments: the mesh sizes and the declarative plan (TP plan, FSDP2 units,
    pipeline split) that parallelizes ``LitGPT``."""
    tp_plan = None
    if args.tp > 1:
        if args.heads % args.tp:
            raise ValueError(f"--heads {args.heads} must be divisible by --tp {args.tp}: each TP rank holds whole heads")
        tp_plan = {f"model.layers.{i}.{n}": style for i in range(args.layers)
                   for n, style in (("qkv", ColwiseParallel()), ("proj", RowwiseParallel()),
                                    ("fc1", ColwiseParallel()), ("fc2", RowwiseParallel()))}
    pipeline = None
    if args.pp > 1:
        per_stage = args.layers // args.pp
        pipeline = PipelineOptions(split_points=[f"layers.{per_stage * s}" for s in range(1, args.pp)], microbatches=2)
        tp_plan = None  # TP inside pipeline stages: see docs/pipeline.md (a parallelize_stage hook)
    return dict(
        dp_shard=args.dp_shard, tp=args.tp if args.pp == 1 else 1, pp=args.pp, pipeline=pipeline,
        plan=ParallelPlan(tp_plan=tp_plan, fsdp_units=(Block,)), loss_normalization="token_mean", log_loss="train/loss",
    )


def main(argv: list[str] | None = None) -> None:
    """Train as the command line ``argv`` (default: ``sys.argv[1:]``) says."""
    args = parse_args(argv)
    share_cpu_threads(args.accelerator, args.devices)

    strategy = NDParallelStrategy(**strategy_kwargs(args))
    clip = GlobalNormClip(args.max_norm, log_module_depth=1)
    logger = TensorBoardLogger(args.logdir, name="gpt")
    callbacks = [VerifyOneDevice(), clip] if args.verify else [clip]  # the check sees the gradients before the clip
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
        callbacks=callbacks, logger=logger, max_steps=args.max_steps, accumulate_grad_batches=args.accumulate,
        log_every_n_steps=5, enable_checkpointing=False, enable_model_summary=False,
    )
    L.seed_everything(0, verbose=False)  # the same initial weights on every rank and for every layout
    trainer.fit(LitGPT(args))
    print_summary(trainer, logger, clip, args.logdir)


if __name__ == "__main__":
    main()
