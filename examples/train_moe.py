"""Train a tiny mixture-of-experts language model with NDParallelStrategy (FSDP2 x expert parallel),
the exact global token mean, GlobalNormClip(1.0) with expert and dense norms logged apart, and
TensorBoard, on documents it generates itself.

    python examples/train_moe.py                            # 4 CPU ranks: dp_shard=4, ep=2, ~30 s on 2 cores
    python examples/train_moe.py --devices 4 --ep 4         # one expert group over all 4 ranks
    python examples/train_moe.py --devices 1 --ep 1 --batch-size 32   # one device: the same losses and norms
    python examples/train_moe.py --accelerator gpu --devices 8 --ep 8 --experts 16 --width 512
    torchrun --nproc-per-node 4 examples/train_moe.py       # or under SLURM: srun python ...

The data: documents from ``--topics`` small random Markov chains (one chain per document, so
experts have something to specialize on), packed into rows of ``--seq-len`` tokens, padding
labelled -100, so ranks hold different numbers of valid tokens.

Expert parallel: each transformer block's feed-forward layer is a top-2 ``MoE``; ``shard_experts``
splits its experts over the ``ep`` ranks (tokens travel to their experts' owner by all-to-all) and
``fully_shard`` shards them over the expert-data-parallel ranks ``edp`` that hold the same experts;
dense weights are sharded over all data ranks. ``GlobalNormClip(expert_pattern=...)`` logs
``grad_norm/expert`` and ``grad_norm/dense`` next to ``grad_norm/total`` (exact:
``expert^2 + dense^2 = total^2``).
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
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_ndclip import GlobalNormClip, NDParallelStrategy, ParallelMeshes, VerifyOneDevice
from lightning_ndclip.core.experts import MoE, shard_experts

EXPERT_PATTERN = r"\.experts\."
"""Names of expert parameters (``model.blocks.0.moe.experts.w_in``); all others are dense."""


def topic_documents(rows: int, seq_len: int, vocab: int, topics: int, seed: int = 0) -> TensorDataset:
    """Rows packed with documents, each from one of ``topics`` Markov chains; each row ends with
    0..seq_len/4 padding tokens (label -100)."""
    g = torch.Generator().manual_seed(seed)
    transitions = torch.softmax(torch.randn(topics, vocab, vocab, generator=g) * 3, dim=-1)
    tokens = torch.zeros(rows, seq_len + 1, dtype=torch.long)
    labels = torch.full((rows, seq_len), -100)
    for r in range(rows):
        used = seq_len + 1 - int(torch.randint(0, seq_len // 4 + 1, (1,), generator=g))
        start = 0
        while start < used:  # documents of 8..seq_len/2 tokens, back to back
            length = min(int(torch.randint(8, seq_len // 2 + 1, (1,), generator=g)), used - start)
            chain = transitions[int(torch.randint(topics, (1,), generator=g))]
            t = int(torch.randint(vocab, (1,), generator=g))
            for i in range(start, start + length):
                tokens[r, i] = t
                t = int(torch.multinomial(chain[t], 1, generator=g))
            start += length
        labels[r, : used - 1] = tokens[r, 1:used]
    return TensorDataset(tokens[:, :-1], labels)


class MoEBlock(nn.Module):
    """Causal self-attention, then a top-2 mixture of expert feed-forward layers."""

    def __init__(self, width: int, heads: int, experts: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.moe = MoE(width, 2 * width, num_experts=experts, top_k=2)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, s, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        return h + self.moe(self.norm2(h))


class MoELM(nn.Module):
    """Token and position embeddings, MoE blocks, head."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, experts: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(seq_len, width) * 0.02)
        self.blocks = nn.ModuleList(MoEBlock(width, heads, experts) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def parallelize_moe(model: MoELM, meshes: ParallelMeshes) -> MoELM:
    """Experts over ``ep`` (and FSDP over ``edp``); every other weight FSDP over all data ranks."""
    for block in model.blocks:
        shard_experts(block.moe, meshes["ep"])
        fully_shard(block.moe.experts, mesh=meshes["edp"])
        fully_shard(block, mesh=meshes["fsdp"])
    fully_shard(model, mesh=meshes["fsdp"])
    return model


class LitMoE(L.LightningModule):
    """Returns the usual mean loss; the strategy makes it the exact global token mean."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.model = MoELM(args.vocab, args.width, args.layers, args.heads, args.experts, args.seq_len)

    def configure_model(self) -> None:
        parallelize_moe(self.model, self.trainer.strategy.meshes)

    def count_tokens(self, batch: list[torch.Tensor]) -> torch.Tensor:  # the strategy's global token count
        return (batch[1] != -100).sum()

    def training_step(self, batch: list[torch.Tensor]) -> torch.Tensor:
        tokens, labels = batch
        logits = self.model(tokens)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.args.lr, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader:
        data = topic_documents(self.args.rows, self.args.seq_len, self.args.vocab, self.args.topics)
        return DataLoader(data, batch_size=self.args.batch_size, shuffle=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_launch_args(p)
    p.add_argument("--dp-shard", type=int, default=-1)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--topics", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--verify", action="store_true", help="check the first step against the model on one process")
    p.add_argument("--log-every-n-steps", type=int, default=5)
    return p.parse_args(argv)


def strategy_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """NDParallelStrategy's arguments (``LitMoE.configure_model`` parallelizes with its meshes)."""
    return dict(dp_shard=args.dp_shard, ep=args.ep, loss_normalization="token_mean", log_loss="train/loss")


def main(argv: list[str] | None = None) -> None:
    """Train as the command line ``argv`` (default: ``sys.argv[1:]``) says."""
    args = parse_args(argv)
    share_cpu_threads(args.accelerator, args.devices)

    strategy = NDParallelStrategy(**strategy_kwargs(args))
    clip = GlobalNormClip(args.max_norm, expert_pattern=EXPERT_PATTERN)
    logger = TensorBoardLogger(args.logdir, name="moe")
    callbacks = [VerifyOneDevice(), clip] if args.verify else [clip]  # the check sees the gradients before the clip
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
        callbacks=callbacks, logger=logger, max_steps=args.max_steps, accumulate_grad_batches=args.accumulate,
        log_every_n_steps=args.log_every_n_steps, enable_checkpointing=False, enable_model_summary=False,
    )
    L.seed_everything(0, verbose=False)  # the same initial weights on every rank and for every layout
    trainer.fit(LitMoE(args))
    print_summary(trainer, logger, clip, args.logdir)


if __name__ == "__main__":
    main()
