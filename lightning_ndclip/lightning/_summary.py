"""The notes the startup summary adds under the table of what was parallelized how
(:func:`~lightning_ndclip.core.parallel.summary.summarize`): the data per optimizer step, the FSDP2 layout's hint,
the pipeline, the context cut and the loss, as the strategy runs them."""

from __future__ import annotations

from lightning_ndclip.core.pipeline import PipelineOptions

__all__ = ["training_notes"]

_LOSSES = {
    "token_mean": "token_mean: each micro-batch's loss is its share of the global token mean (count_tokens, summed over "
    "dp per window)",
    "sample_mean": "sample_mean: the hierarchical per-sample mean (sample_ids, summed over cp and dp per window)",
}


def training_notes(
    *, batch_size: object, data_ranks: int, accumulate: int, whole_module_unit: bool,
    pipeline: tuple[PipelineOptions, int, int] | None, context: str | None, normalization: str | None,
    sum_reduction: bool,
) -> list[str]:  # fmt: skip
    """The notes: ``batch_size`` the training dataloader's (an int, else unknown), ``data_ranks`` and ``accumulate``
    the other two factors of a step's samples; ``pipeline`` (options, micro-batches per batch, pp) where there is
    one; ``context`` the cut's own description where the library models' sequences are cut."""
    if isinstance(batch_size, int):
        per_step = (
            f"{batch_size} per rank x dp={data_ranks} ranks x {accumulate} accumulated = {batch_size * data_ranks * accumulate}"
        )
    else:
        per_step = f"(the dataloader has no batch_size) x dp={data_ranks} ranks x {accumulate} accumulated"
    notes = [f"Data: samples per optimizer step: {per_step}"]
    if whole_module_unit:
        notes.append(
            "FSDP2: the whole module is one unit (no plan, no configure_model): its parameters are gathered all at "
            "once; plan=ParallelPlan(fsdp_units=[YourBlock]) gathers one block at a time, overlapping communication "
            "with compute and holding less memory"
        )
    if pipeline is not None:
        options, microbatches, pp = pipeline
        notes.append(
            f"Pipeline: schedule {options.schedule!r}, {microbatches} micro-batches per batch, "
            f"{pp * options.stages_per_rank} stages ({options.stages_per_rank} per rank)"
        )
    if context is not None:
        notes.append(f"Context: {context}")
    loss = _LOSSES.get(normalization or "") or (
        "sum_reduction: FSDP2 sums gradients; training_step normalizes by global counts itself"
        if sum_reduction
        else "Lightning's per-rank mean, averaged by the data-parallel reduction"
    )
    notes.append(f"Loss: {loss}")
    return notes
