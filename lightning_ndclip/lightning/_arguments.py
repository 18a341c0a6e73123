"""``NDParallelStrategy``'s arguments, checked when it is built (before any process group exists): the sizes against
each other, Lightning's ``data_parallel_size`` / ``tensor_parallel_size`` mapped onto ``dp_shard`` / ``tp``, the
choices, and the plan and pipeline options against the sizes. Each error names the argument and shows the
arithmetic; 0.1.0's keywords name their new place."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from typing import Any, Literal

from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_ndclip.core.parallel.plan import ParallelPlan, check_plan_sizes
from lightning_ndclip.core.pipeline import PipelineOptions

__all__ = [
    "LightningSize", "check_choice", "check_plan_and_pipeline", "lightning_sizes", "refuse_unexpected", "resolve_sizes",
]  # fmt: skip

_SIZES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
_ACCEPTED = (*_SIZES, "data_parallel_size", "tensor_parallel_size", *inspect.signature(ModelParallelStrategy).parameters)

LightningSize = int | Literal["auto"]

_MOVED = {  # 0.1.0's keywords, now in the plan and pipeline objects
    **{name: f"plan=ParallelPlan({name}=...)" for name in ("tp_plan", "fsdp_units", "activation_checkpointing", "mp_policy")},
    **{f"pp_{name}": f"pipeline=PipelineOptions({name}=...)" for name in (f.name for f in dataclasses.fields(PipelineOptions))},
}


def lightning_sizes(
    data_parallel_size: LightningSize | None, tensor_parallel_size: LightningSize | None, sizes: dict[str, int]
) -> tuple[LightningSize, LightningSize] | None:
    """``ModelParallelStrategy``'s two sizes, checked, when either is given (the other defaults to
    ``"auto"``, as there); ``None`` when neither is."""
    if data_parallel_size is None and tensor_parallel_size is None:
        return None
    given = {"data_parallel_size": data_parallel_size, "tensor_parallel_size": tensor_parallel_size}
    for name, value in given.items():
        if value is not None and value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive int or 'auto' (Lightning's meaning), got {value!r}")
    clashes = [f"{ours}={sizes[ours]}" for ours, default in (("dp_replicate", 1), ("dp_shard", -1)) if sizes[ours] != default]
    if data_parallel_size is not None and clashes:
        raise TypeError(f"give data_parallel_size (Lightning's name for dp_shard) or {' / '.join(clashes)}, not both")
    if tensor_parallel_size is not None and sizes["tp"] != 1:
        raise TypeError(f"give tensor_parallel_size (Lightning's name for tp) or tp={sizes['tp']}, not both")
    return data_parallel_size or "auto", tensor_parallel_size or "auto"


def resolve_sizes(
    sizes: dict[str, int],
    lightning: tuple[LightningSize, LightningSize] | None,
    num_nodes: int,
    devices_per_node: int,
) -> dict[str, int]:
    """The N-D sizes, with Lightning's two mapped onto ``dp_shard`` and ``tp``: ``"auto"`` is the number
    of nodes for data parallel and the devices per node for tensor parallel, as in ``ModelParallelStrategy``."""
    if lightning is None:
        return dict(sizes)
    data, tensor = lightning
    return {
        **sizes,
        "dp_shard": num_nodes if data == "auto" else data,
        "tp": devices_per_node if tensor == "auto" else tensor,
    }


def refuse_unexpected(unexpected: dict[str, Any]) -> None:
    """A keyword ``NDParallelStrategy`` does not take: where 0.1.0's went, or the closest accepted one."""
    if not unexpected:
        return
    name = next(iter(unexpected))
    if name in _MOVED:
        raise TypeError(f"NDParallelStrategy({name}=...) is now {_MOVED[name]}")
    close = difflib.get_close_matches(name, _ACCEPTED, n=1)
    raise TypeError(
        f"NDParallelStrategy got an unexpected keyword argument {name!r}"
        + (f"; did you mean {close[0]!r}?" if close else "")
        + f" Sizes: {', '.join(_SIZES)} (or Lightning's data_parallel_size / tensor_parallel_size)"
    )


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be {' or '.join(repr(c) for c in choices)}, got {value!r}")


def check_plan_and_pipeline(
    plan: ParallelPlan,
    pipeline: PipelineOptions,
    sizes: dict[str, int],
) -> None:
    """The arguments that must agree with the sizes: a tp plan needs tp > 1 (:func:`check_plan_sizes`); the
    split points make ``pp x stages_per_rank`` stages; ``transformers`` models are cut along the sequence outside a
    pipeline."""
    tp, pp, ep, cp = sizes["tp"], sizes["pp"], sizes["ep"], sizes["cp"]
    check_plan_sizes(plan.tp_plan, tp, ep, cp)
    if plan.cuts_sequences(cp) and pp > 1:
        raise ValueError(
            "NDParallelStrategy(cp > 1, pp > 1) with tp_plan='auto': transformers models are cut along the sequence "
            "only outside a pipeline so far; use cp or pp"
        )
    stages = pp * pipeline.stages_per_rank
    if pp > 1 and pipeline.split_points and len(pipeline.split_points) != stages - 1:
        raise ValueError(
            f"pp={pp} x stages_per_rank={pipeline.stages_per_rank} = {stages} stages need {stages - 1} "
            f"PipelineOptions(split_points), got {list(pipeline.split_points)}"
        )
