r"""Loss parallel: cross-entropy on logits sharded along the vocabulary, never gathered.

With a large vocabulary (Qwen's 152k, Gemma's 256k) the logits and their gradient dominate memory at long
sequences: a ``ColwiseParallel`` LM head that gathers its output holds ``[tokens, vocab]`` on every tp rank,
and the loss makes two or three more of that size (a float32 copy, the saved softmax, the gradient). Loss
parallel keeps each tp rank's block of the vocabulary, ``[tokens, vocab / tp]``:

* the head is ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``
  (:func:`vocab_parallel_head`): its output is a ``DTensor`` sharded along the vocabulary, with the meaning of
  the whole logits (an op on it computes what it computes on the whole logits, gathering where it must);
* :func:`vocab_parallel_cross_entropy` computes each token's loss
  :math:`\ell_i = \log \sum_v e^{z_{i,v}} - z_{i,y_i}` from the shards: the row max over tp (one all-reduce,
  MAX), then the sum of :math:`e^{z - \max}` and the target logit, held by the rank owning the label's block
  (one all-reduce, SUM, of both). Every tp rank gets the same per-token losses, as with gathered logits,
  so the package's token mean and sample mean consume them unchanged. Backward needs no collective: the
  gradient of a rank's logits is :math:`(\mathrm{softmax}_{i,v} - [v = y_i])\,\partial L/\partial \ell_i` on
  its block (the head's ``ColwiseParallel`` sums the hidden states' gradient over tp, as it always does);
* :func:`loss_parallel_plan` rewrites a tensor-parallel plan's LM head to that style
  (``ParallelPlan(loss_parallel=True)`` calls it), and for a ``transformers`` causal LM also replaces the
  model's own loss (``ForCausalLMLoss``) by
  :func:`~lightning_ndclip.integrations.transformers.plans.vocab_parallel_causal_lm_loss`, so its ``.loss`` is
  computed on the shards.

A tied LM head (its weight the input embedding's) stays tied: both sides keep sharding the ``[vocab, hidden]``
weight along the vocabulary (``Shard(0)``), as without loss parallel
(:func:`~lightning_ndclip.core.parallel.tensor_parallel.tensor_parallelize`).

Computed in at least float32 (as ``transformers`` upcasts its logits), ``ignore_index`` tokens contribute 0.
A label outside ``[0, vocab)`` (other than ``ignore_index``) raises a ``ValueError`` on the CPU, where reading it
is free (``F.cross_entropy`` raises too), and makes that token's loss NaN on accelerators (no host sync).
Saved for backward: one float32 ``[tokens, vocab / tp]`` buffer, which backward turns into the gradient in
place; a second backward through the same graph (``retain_graph=True``) is refused by autograd.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from lightning_ndclip.core import libraries
from lightning_ndclip.core.agree import host_reads_are_free
from lightning_ndclip.core.parallel.tensor_parallel import matches_plan_key

__all__ = ["loss_parallel_plan", "vocab_parallel_cross_entropy", "vocab_parallel_head"]

_REDUCTIONS = ("none", "sum", "mean")


def vocab_parallel_head() -> ColwiseParallel:
    """The LM head's style under loss parallel: ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``,
    its logits a ``DTensor`` sharded along the vocabulary (the weight ``Shard(0)``, as any colwise head's)."""
    return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)


def _is_vocab_parallel(style: ParallelStyle) -> bool:
    return (
        type(style) is ColwiseParallel
        and isinstance(style.output_layouts[0], Shard)
        and style.output_layouts[0].dim == -1
        and not style.use_local_output
    )


def _is_gathered_colwise(style: ParallelStyle) -> bool:
    return type(style) is ColwiseParallel and isinstance(style.output_layouts[0], Replicate)


class _ShardedCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of ``[tokens, block]`` logits, this rank's block of the vocabulary (from ``offset``),
    reduced over ``group``; see the module docstring."""

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, target: torch.Tensor, offset: int, group: dist.ProcessGroup | None, ignore_index: int
    ) -> torch.Tensor:
        wide = torch.promote_types(local.dtype, torch.float32)
        rows, width = local.shape
        if width:
            row_max = local.detach().amax(dim=-1).to(wide)
        else:  # a rank without a block (vocab < tp): it only joins the collectives
            row_max = torch.full((rows,), -torch.inf, dtype=wide, device=local.device)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = local.detach() - row_max[:, None]  # one new [tokens, block] buffer, in the wide dtype
        owned = (target >= offset) & (target < offset + width)
        index = (target - offset).clamp(0, max(width - 1, 0))
        if width:
            own = torch.where(owned, shifted.gather(1, index[:, None]).squeeze(1), 0.0)
        else:
            own = torch.zeros(rows, dtype=wide, device=local.device)
        probs = shifted.exp_()
        sums = torch.stack([probs.sum(dim=-1), own])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        total, target_logit = sums.unbind()
        valid = target != ignore_index
        loss = torch.where(valid, total.log() - target_logit, 0.0)
        probs.div_(total[:, None])
        ctx.save_for_backward(probs, index, owned & valid, valid)
        ctx.dtype = local.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        probs, index, hit, valid = ctx.saved_tensors
        scale = torch.where(valid, grad_loss.to(probs.dtype), 0.0)
        grad = probs.mul_(scale[:, None])  # in place: the saved softmax becomes the gradient
        if grad.shape[1]:
            grad.scatter_add_(1, index[:, None], -torch.where(hit, scale, 0.0)[:, None])
        return grad.to(ctx.dtype), None, None, None, None


def _reduced(losses: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum()  # nan without a valid token, as F.cross_entropy


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100, reduction: str = "none"
) -> torch.Tensor:
    """Cross-entropy of ``logits`` against ``labels``, computed on the vocabulary shards when ``logits`` is a
    ``DTensor`` sharded along its last dim (the output of a :func:`vocab_parallel_head`), without gathering them.

    The same function on plain logits is ``F.cross_entropy`` in at least float32: code written with it runs
    unchanged with and without loss parallel. Labels are not shifted (shift them as your model does).

    Args:
        logits: ``[..., vocab]``: a plain tensor, or a ``DTensor`` that is ``Shard(-1)`` on one mesh dim
            (the tp dim) and ``Replicate`` on any other.
        labels: class ids shaped like ``logits`` without its last dim (a plain tensor: the same on every tp rank).
        ignore_index: the label of tokens that do not count (loss 0, no gradient).
        reduction: ``"none"`` (per-token losses shaped like ``labels``, 0 at ignored tokens: what
            ``loss_normalization="token_mean"`` / ``"sample_mean"`` take), ``"sum"``, or ``"mean"`` (over the
            tokens that count; NaN without any, as ``F.cross_entropy``).

    Returns:
        The losses in ``promote_types(logits.dtype, float32)``, a plain tensor, equal on every tp rank.

    Raises:
        ValueError: an unknown ``reduction``; ``labels`` not shaped like ``logits[..., 0]``; a ``DTensor`` not
            sharded along the vocabulary alone (a ``Partial`` or sequence-sharded one); on the CPU, a label
            outside ``[0, vocab)`` other than ``ignore_index`` (on accelerators its loss is NaN instead).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if isinstance(labels, DTensor):
        labels = labels.full_tensor()
    if tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(
            f"labels must be shaped like the logits without their vocabulary dim, {tuple(logits.shape[:-1])}, got "
            f"{tuple(labels.shape)}"
        )
    vocab = logits.shape[-1]
    target = labels.reshape(-1).to(device=logits.device, dtype=torch.int64)
    valid = target != ignore_index
    if not isinstance(logits, DTensor):
        wide = torch.promote_types(logits.dtype, torch.float32)
        flat = logits.reshape(-1, vocab).to(wide)
        losses = nn.functional.cross_entropy(flat, target, ignore_index=ignore_index, reduction="none")
        return _reduced(losses.view(labels.shape), valid.view(labels.shape), reduction)
    local, group, offset = _vocab_block(logits)
    bad = valid & ((target < 0) | (target >= vocab))
    if host_reads_are_free(local.device):  # every tp rank holds the same labels and raises alike
        if bool(bad.any()):
            found = target[bad][:5].tolist()
            raise ValueError(f"labels must lie in [0, {vocab}) or be ignore_index={ignore_index}, got {found}")
    losses = _ShardedCrossEntropy.apply(local.reshape(-1, local.shape[-1]), target, offset, group, ignore_index)
    if not host_reads_are_free(local.device):
        losses = torch.where(bad, torch.nan, losses)
    return _reduced(losses.view(labels.shape), valid.view(labels.shape), reduction)


def _vocab_block(logits: DTensor) -> tuple[torch.Tensor, dist.ProcessGroup, int]:
    """``logits``' local block (differentiable), the group of the mesh dim that shards the vocabulary, and the block's
    first vocabulary index (DTensor's split: ``ceil(vocab / n)`` per rank, the last ones shorter or empty)."""
    placements = logits.placements
    last = logits.ndim - 1
    split = [i for i, p in enumerate(placements) if not p.is_replicate()]
    if len(split) != 1 or not placements[split[0]].is_shard(last) and not placements[split[0]].is_shard(-1):
        raise ValueError(
            f"vocab_parallel_cross_entropy takes logits sharded along the vocabulary (Shard(-1)) on one mesh dim and "
            f"replicated on the others, got placements {tuple(placements)}; give the LM head vocab_parallel_head()"
        )
    dim = split[0]
    mesh = logits.device_mesh
    size, rank = mesh.size(dim), mesh.get_local_rank(dim)
    vocab = logits.shape[-1]
    chunk = -(-vocab // size)
    offset = min(rank * chunk, vocab)
    local = logits.to_local()
    if local.shape[-1] != min(chunk, vocab - offset):
        raise ValueError(
            f"rank {rank} of {size} holds {local.shape[-1]} of {vocab} logits, not DTensor's even split "
            f"({min(chunk, vocab - offset)} from {offset}): the vocabulary blocks are unknown"
        )
    return local, mesh.get_group(dim), offset


def _heads_of(module: nn.Module, plan: Mapping[str, ParallelStyle], head: bool | str) -> tuple[list[str], dict[str, Any]]:
    """The plan keys of the LM heads, and the ``transformers`` models they are the output embeddings of (by head
    name)."""
    names = {name: child for name, child in module.named_modules() if name}
    models: dict[str, Any] = {}
    if isinstance(head, str):
        keys = [head] if head in plan else []
        if not keys:
            raise ValueError(f"loss_parallel={head!r} names no entry of the tp plan (its keys: {sorted(plan)})")
    else:
        models = {name: model for library in libraries.registered() for name, model in library.output_heads(module).items()}
        if models:
            # a head without parameters is a pipeline stage's stand-in for the head another stage holds
            models = {name: model for name, model in models.items() if any(True for _ in names[name].parameters())}
            keys = sorted({key for name in models for key in plan if matches_plan_key(name, key)})
            # a head the model's plan leaves whole (transformers 5.0-5.x kept lm_head in the class's _tp_plan only):
            # loss parallel is sharding it, so it gets an entry of its own
            keys += [name for name in models if not any(matches_plan_key(name, key) for key in plan)]
        else:
            keys = [
                key
                for key, style in plan.items()
                if (_is_gathered_colwise(style) or _is_vocab_parallel(style))
                and any(matches_plan_key(n, key) and isinstance(m, nn.Linear) for n, m in names.items())
            ]
            if len(keys) != 1:
                raise ValueError(
                    "loss_parallel=True looks for the LM head: the one tp plan entry that is a ColwiseParallel "
                    f"nn.Linear with a gathered output (output_layouts=Replicate()), and found {keys or 'none'}; name "
                    "it: loss_parallel='<its plan key>'"
                )
    for key in keys:
        style = plan.get(key)  # None: a head the plan leaves out, which loss parallel shards
        matched = {n: m for n, m in names.items() if matches_plan_key(n, key)}
        wrong = [f"{n} ({type(m).__name__})" for n, m in matched.items() if not isinstance(m, nn.Linear)]
        if (style is not None and type(style) is not ColwiseParallel) or wrong or not matched:
            raise ValueError(
                f"loss parallel: the head entry {key!r} must be a ColwiseParallel style on nn.Linear modules (it "
                f"shards the vocabulary), got {type(style).__name__} on {wrong or sorted(matched) or 'no module'}"
            )
        others = [n for n in matched if models and n not in models]
        if others:
            raise ValueError(
                f"loss parallel: the head entry {key!r} also matches {others}, which are no LM head: their outputs "
                "would become vocabulary-sharded DTensors; give the heads an entry of their own"
            )
    return keys, models


def head_keys(module: nn.Module, plan: Mapping[str, ParallelStyle], head: bool | str = True) -> list[str]:
    """The plan keys of ``module``'s LM heads, as :func:`loss_parallel_plan` finds them (raising as it does)."""
    return _heads_of(module, plan, head)[0]


def loss_parallel_plan(
    module: nn.Module, plan: Mapping[str, ParallelStyle] | None, head: bool | str = True
) -> dict[str, ParallelStyle]:
    """``plan`` with the LM head made :func:`vocab_parallel_head` (its logits a vocabulary-sharded ``DTensor``),
    for :func:`~lightning_ndclip.core.parallel.tensor_parallel.tensor_parallelize` (``ParallelPlan(loss_parallel=...)``
    calls it on the resolved plan, ``tp_plan="auto"`` included).

    The head: with ``head=True``, the output embeddings (``get_output_embeddings()``) of the ``transformers``
    models inside ``module`` (given an entry where the plan has none), whose own loss is then replaced by
    :func:`~lightning_ndclip.integrations.transformers.plans.vocab_parallel_causal_lm_loss` (their ``.loss`` is computed on the
    shards; a model whose loss is not ``transformers``' ``ForCausalLMLoss`` is refused); without such models, the
    one plan entry that is a ``ColwiseParallel`` ``nn.Linear`` with a gathered output (``output_layouts=Replicate()``).
    A string names the head's plan key. Your own loss must then be :func:`vocab_parallel_cross_entropy` on the
    logits (plain ``F.cross_entropy`` on the ``DTensor`` is refused by DTensor or gathers them; on
    ``logits.to_local()`` it computes another loss).

    Raises:
        ValueError: an empty plan (loss parallel needs ``tp > 1`` and a plan that shards the head); no head, or
            several, found; a head entry that is not a ``ColwiseParallel`` on ``nn.Linear`` modules or that also
            matches modules that are no head; a ``transformers`` model whose loss is not ``ForCausalLMLoss``.
    """
    if not plan:
        raise ValueError("loss_parallel needs tp > 1 and a tp plan that shards the LM head (colwise)")
    keys, models = _heads_of(module, plan, head)
    rewritten = {key: (vocab_parallel_head() if key in keys else style) for key, style in plan.items()}
    rewritten.update((key, vocab_parallel_head()) for key in keys if key not in plan)
    for model in models.values():
        library = libraries.library_of(model)
        assert library is not None  # found as a library model's head
        library.use_vocab_parallel_loss(model)
    return rewritten
