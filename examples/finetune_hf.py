"""Fine-tune a Hugging Face transformers causal LM with NDParallelStrategy: its own tensor- and expert-parallel
plans and context parallelism (``tp_plan="auto"``), FSDP2, the exact global token mean, GlobalNormClip(1.0) and
TensorBoard.

    python examples/finetune_hf.py                                   # a tiny Qwen3-MoE, 4 CPU ranks: dp_shard=4, ep=2
    python examples/finetune_hf.py --dp-shard 2 --tp 2 --ep 2        # experts over ep, each split over tp
    python examples/finetune_hf.py --family llama --dp-shard 2 --tp 2 --verify   # checked against one process
    python examples/finetune_hf.py --dp-shard 2 --cp 2 --verify      # sequences cut over cp, experts over ep
    python examples/finetune_hf.py --model path/to/checkpoint --accelerator gpu --devices 8 --ep 8
    python examples/finetune_hf.py --model path/to/checkpoint --pp 2 --dp-shard 2 --ep 1   # stages, loaded from disk
    torchrun --nproc-per-node 4 examples/finetune_hf.py              # or under SLURM: srun python ...

``--model`` is a local checkpoint directory (``config.json`` and safetensors files, as ``save_pretrained``
writes them): the model is built on the meta device and the strategy loads the checkpoint straight into each
rank's shards (``hf_checkpoint=``). Without it a tiny random ``--family`` model is built offline. The data:
documents from small random Markov chains over the vocabulary, packed into rows of ``--seq-len`` tokens with
padding labelled -100, so ranks hold different numbers of valid tokens; batches are dicts, as transformers'
collators make them (under ``--cp`` the strategy cuts their sequences). The loss is the model's own (``labels=``,
shifted inside transformers), so the strategy counts the tokens it averages over: ``labels[:, 1:]``.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from _common import add_launch_args, print_summary, share_cpu_threads  # examples/_common.py
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader
from train_moe import topic_documents  # examples/train_moe.py: packed Markov-chain documents

from lightning_ndclip import GlobalNormClip, NDParallelStrategy, ParallelPlan, PipelineOptions, VerifyOneDevice

TINY: dict[str, tuple[str, str, dict[str, Any]]] = {
    # --family: (config class, model class, arguments), each small enough for CPU ranks
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 64}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}  # fmt: skip


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """The checkpoint's architecture on the meta device (the strategy fills it), or a tiny random model."""
    import transformers

    if args.model:
        config = transformers.AutoConfig.from_pretrained(args.model)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    config_class, model_class, extra = TINY[args.family]
    config = getattr(transformers, config_class)(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=2 * args.width, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len, **extra,
    )  # fmt: skip
    return getattr(transformers, model_class)(config)


class FineTune(L.LightningModule):
    """The model's own loss on (input_ids, labels) batches; the strategy makes it the exact global token mean."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.lm = build_model(args)
        self.vocab = self.lm.config.get_text_config().vocab_size  # self.lm becomes its stages under --pp

    def count_tokens(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:  # what the shifted loss averages over
        return (batch["labels"][:, 1:] != -100).sum()

    def training_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.args.pp > 1:  # stages cut from the model: the last one's logits against the next tokens
            labels = batch["labels"]
            next_tokens = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
            return self.trainer.strategy.run_pipeline(batch["input_ids"], next_tokens)
        return self.lm(**batch).loss

    def pipeline_loss(self, logits: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), next_tokens.flatten(), ignore_index=-100, reduction="none")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.args.lr, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader:
        tokens, next_tokens = topic_documents(self.args.rows, self.args.seq_len, self.vocab, self.args.topics).tensors
        labels = torch.cat([tokens[:, :1], next_tokens[:, :-1]], dim=1)  # transformers' loss shifts them back itself
        rows = [{"input_ids": t, "labels": y} for t, y in zip(tokens, labels)]
        return DataLoader(rows, batch_size=self.args.batch_size, shuffle=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_launch_args(p)
    p.add_argument("--model", default=None, help="a local checkpoint directory (default: a tiny random --family model)")
    p.add_argument("--family", choices=sorted(TINY), default="qwen3-moe")
    p.add_argument("--dp-shard", type=int, default=-1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1, help="context parallel: each sequence cut into 2 x cp chunks")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel: stages cut from the model's own plan")
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--topics", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--verify", action="store_true", help="check the first step against the model on one process")
    p.add_argument("--log-every-n-steps", type=int, default=5)
    return p.parse_args(argv)


def decoder_layer(model: torch.nn.Module) -> type[torch.nn.Module]:
    """The class of the model's decoder layers, each one FSDP2 unit."""
    return type(model.get_decoder().layers[0])


def strategy_kwargs(args: argparse.Namespace, model: torch.nn.Module) -> dict[str, Any]:
    auto = args.tp > 1 or args.ep > 1 or args.cp > 1
    plan = ParallelPlan(tp_plan="auto" if auto else None, fsdp_units=[decoder_layer(model)])
    pipeline = PipelineOptions(module="lm") if args.pp > 1 else None
    return dict(dp_shard=args.dp_shard, cp=args.cp, tp=args.tp, pp=args.pp, ep=args.ep, plan=plan, pipeline=pipeline,
                loss_normalization="token_mean", log_loss="train/loss", hf_checkpoint=args.model)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Train as the command line ``argv`` (default: ``sys.argv[1:]``) says."""
    args = parse_args(argv)
    share_cpu_threads(args.accelerator, args.devices)
    L.seed_everything(0, verbose=False)  # the same initial weights on every rank and for every layout
    module = FineTune(args)
    clip = GlobalNormClip(args.max_norm, expert_pattern=r"\.experts\.")
    logger = TensorBoardLogger(args.logdir, name="finetune_hf")
    callbacks = [VerifyOneDevice(), clip] if args.verify else [clip]  # the check sees the gradients before the clip
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
        strategy=NDParallelStrategy(**strategy_kwargs(args, module.lm)), callbacks=callbacks, logger=logger,
        max_steps=args.max_steps, accumulate_grad_batches=args.accumulate, log_every_n_steps=args.log_every_n_steps,
        enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    print_summary(trainer, logger, clip, args.logdir)


if __name__ == "__main__":
    main()
