"""Check on a GPU: which host synchronizations a steady-state training step makes, and whose they are.

A small LM is trained with ``NDParallelStrategy(loss_normalization="token_mean")`` and
``GlobalNormClip`` on one CUDA device (world size 1, NCCL), accumulating 2 micro-batches per step.
From the third optimizer step on, every micro-batch runs under
``torch.cuda.set_sync_debug_mode("warn")``: each host synchronization warns, and the call stack of
the warning is kept. Each synchronization is attributed to the innermost frame of the first
package on its stack that is not torch: ``lightning_ndclip`` (ours), ``lightning`` (the Trainer's
own loop and logging), or the script (the model). Run by hand on a GPU (see README.md)::

    python benchmarks/gpu_step_syncs.py --nonfinite skip     # writes results/gpu_step_syncs_skip.md / .json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import traceback
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn

import lightning_ndclip as nd

VOCAB, WIDTH, SEQ, BATCH = 512, 256, 64, 8


class Block(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))


class LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(*(Block() for _ in range(4)))
        self.head = nn.Linear(WIDTH, VOCAB)

    def count_tokens(self, batch) -> torch.Tensor:
        return (batch[1] != -100).sum()

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self.head(self.blocks(self.embed(tokens)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (BATCH * 16, SEQ), generator=g)
        labels = torch.where(torch.rand(tokens.shape, generator=g) < 0.2, -100, tokens.roll(-1, 1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, labels), batch_size=BATCH)


class SyncRecorder(L.Callback):
    """Warn on every host sync during the micro-batches of optimizer steps >= ``first``; keep who made it."""

    def __init__(self, first: int) -> None:
        self.first, self.origins = first, collections.Counter()
        self.micro_batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step >= self.first:
            self.micro_batches += 1
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")

    def record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "called a synchronizing" not in str(message):
            return
        stack = traceback.extract_stack()[:-2]
        mine = [f for f in stack if "lightning_ndclip" in f.filename]
        lightning = [f for f in stack if "/lightning/" in f.filename or "pytorch_lightning" in f.filename]
        frame = (mine or lightning or [f for f in stack if "torch" not in f.filename] or stack)[-1]
        owner = "lightning_ndclip" if mine else "lightning" if lightning else "script"
        where = f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
        self.origins[(owner, where, str(message).splitlines()[0][:80])] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nonfinite", choices=["skip", "raise", "clip"], default="skip", help="GlobalNormClip's")
    parser.add_argument("--log-every-n-steps", type=int, default=0, help="0: no logger; else a CSV logger")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    recorder = SyncRecorder(first=2)
    warnings.showwarning = recorder.record
    warnings.simplefilter("always")
    plan = nd.ParallelPlan(fsdp_units=[Block])
    strategy = nd.NDParallelStrategy(plan=plan, loss_normalization="token_mean", summary=False)
    trainer = L.Trainer(
        accelerator="cuda" if torch.cuda.is_available() else "cpu", devices=1, strategy=strategy,
        max_steps=args.steps, accumulate_grad_batches=2, callbacks=[nd.GlobalNormClip(1.0, nonfinite=args.nonfinite), recorder],
        logger=CSVLogger(tempfile.mkdtemp()) if args.log_every_n_steps else False,
        log_every_n_steps=max(args.log_every_n_steps, 1), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(LM())
    steps = args.steps - recorder.first
    rows = sorted(recorder.origins.items(), key=lambda kv: (kv[0][0], -kv[1]))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (dry run)"
    data = {"device": device, "torch": torch.__version__, "lightning": L.__version__,
            "steps": steps, "micro_batches": recorder.micro_batches,
            "syncs": [{"owner": o, "where": w, "message": m, "count": c} for (o, w, m), c in rows]}  # fmt: skip
    logging = f"a CSV logger every {args.log_every_n_steps} steps" if args.log_every_n_steps else "no logger"
    lines = [f"# Host synchronizations per steady-state step on {data['device']} (torch {data['torch']}, "
             f"Lightning {data['lightning']})", "",
             "NDParallelStrategy(loss_normalization='token_mean'), FSDP2 units per block, "
             f"GlobalNormClip(1.0, nonfinite={args.nonfinite!r}), "
             "fused AdamW, world size 1, "
             f"2 micro-batches per step, {logging}; {steps} steps ({recorder.micro_batches} micro-batches) under "
             "`torch.cuda.set_sync_debug_mode('warn')`. See README.md.", "",
             "| owner | where | per step | message |", "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['owner']} | `{r['where']}` | {r['count'] / steps:g} | {r['message']} |" for r in data["syncs"]]
    if not data["syncs"]:
        lines.append("| - | - | 0 | no host synchronization |")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"gpu_step_syncs_{args.nonfinite}{f'_log{args.log_every_n_steps}' if args.log_every_n_steps else ''}"
    Path(f"{stem}.json").write_text(json.dumps(data, indent=1))
    Path(f"{stem}.md").write_text("\n".join(lines + [""]))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
