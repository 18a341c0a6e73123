"""The trap VerifyOneDevice's how-to lists first, tried as a new user would: a transformer block whose fused
``qkv = Linear(d, 3d)`` output is split with ``.chunk(3, -1)`` into heads, ``ColwiseParallel`` on ``qkv`` in a
declarative plan, ``dp_shard=2 x tp=2``, accumulation 2, ``VerifyOneDevice()`` and ``GlobalNormClip``: every rank
stops at the first forward with a ``ValueError`` naming ``qkv`` (it trained, and only the verifier's comparison with
one device showed it, naming another layer's weights first)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from harness import run_on_ranks
from helpers import use_existing_process_group
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import lightning_ndclip as nd

WIDTH, HEADS, VOCAB, SEQ = 16, 4, 32, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = (t.view(b, s, -1, WIDTH // HEADS).transpose(1, 2) for t in self.qkv(self.norm1(h)).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        return h + self.fc2(F.gelu(self.fc1(self.norm2(h))))


class GPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)

    def count_tokens(self, batch) -> torch.Tensor:
        return (batch[1] != -100).sum()

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]).flatten(0, 1), batch[1].flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        tokens, labels = torch.randint(0, VOCAB, (16, SEQ), generator=g), torch.randint(0, VOCAB, (16, SEQ), generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, labels), batch_size=2)


def _fit_case() -> str:
    use_existing_process_group()
    plan = {f"layers.*.{n}": style for n, style in (("qkv", ColwiseParallel()), ("proj", RowwiseParallel()),
                                                     ("fc1", ColwiseParallel()), ("fc2", RowwiseParallel()))}  # fmt: skip
    strategy = nd.NDParallelStrategy(
        dp_shard=2, tp=2, plan=nd.ParallelPlan(tp_plan=plan, fsdp_units=[Block]), loss_normalization="token_mean",
        summary=False,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, callbacks=[nd.VerifyOneDevice(), nd.GlobalNormClip(1.0)],
        max_steps=1, accumulate_grad_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(GPT())
    except ValueError as error:
        return str(error)
    return "trained"


def test_a_fused_qkv_chunked_under_colwise_parallel_is_named_at_the_first_forward():
    for message in run_on_ranks(4, _fit_case):
        assert message.startswith("layers.0.qkv is ColwiseParallel"), message
        assert "chunk(3, dim=-1)" in message
