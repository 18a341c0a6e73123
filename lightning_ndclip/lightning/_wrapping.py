"""How ``NDParallelStrategy`` parallelizes the LightningModule at setup, where ``configure_model`` did not: the pipeline
stages cut, or the declarative plan applied (the LightningModule's children the root FSDP2 units), or, with only
data-parallel sizes and nothing else given, the whole module one FSDP2 unit (as Lightning's ``FSDPStrategy``)."""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.fsdp import FSDPModule

from lightning_ndclip.core.parallel.mesh import ParallelMeshes
from lightning_ndclip.core.parallel.plan import ParallelPlan, shared_parameters
from lightning_ndclip.lightning._pipeline import PipelineRunner

__all__ = ["whole_module_unit", "wrap"]


def wrap(
    module: pl.LightningModule, plan: ParallelPlan, meshes: Callable[[], ParallelMeshes], sizes: dict[str, int],
    pipeline: PipelineRunner | None, strategy: str,
) -> None:  # fmt: skip
    """Cut the pipeline stages, or apply the declarative plan; a module that has neither must have parallelized itself
    in ``configure_model`` (which Lightning ran before ``setup``; ``strategy`` names the strategy in that error).
    ``meshes`` gives the strategy's meshes, asked only where they are used (Lightning's own tests set up a strategy
    whose processes never started)."""
    if pipeline is not None:
        pipeline.setup(module, meshes(), plan)
        if pipeline.config.tied_parameters and not module.automatic_optimization:  # the same on every rank
            raise ValueError(
                "NDParallelStrategy(pp > 1) with tied parameters needs automatic optimization: the copies' "
                "gradients are summed over their stages after training_step returns, and manual optimization "
                "steps before that, each copy on its own stage's gradient"
            )
    elif plan or whole_module_unit(module, sizes):
        _apply_declarative_plan(module, plan, meshes())
    elif not is_overridden("configure_model", module):
        raise TypeError(
            f"When using the {strategy}, you are required to override the `configure_model()` hook "
            "in the LightningModule and apply parallelization there, or to give the strategy a declarative "
            "plan (plan=ParallelPlan(fsdp_units=..., tp_plan=...))."
        )


def whole_module_unit(module: pl.LightningModule, sizes: dict[str, int]) -> bool:
    """Whether ``module`` becomes one FSDP2 unit as it is (as Lightning's ``FSDPStrategy`` shards a module): only
    data-parallel sizes given (``dp_shard`` / ``dp_replicate``), no plan, no ``configure_model``; with tp, cp, pp or
    ep the strategy cannot guess the rest, and with no size at all it stays Lightning's ``ModelParallelStrategy``,
    which asks for ``configure_model``."""
    data_given = sizes["dp_shard"] != -1 or sizes["dp_replicate"] > 1
    others = max(sizes["tp"], sizes["cp"], sizes["pp"], sizes["ep"]) > 1
    return data_given and not others and not is_overridden("configure_model", module)


def _apply_declarative_plan(module: pl.LightningModule, plan: ParallelPlan, meshes: ParallelMeshes) -> None:
    """Parallelize a LightningModule that has no ``configure_model`` with ``plan`` (once: a module already holding
    FSDP2 units, from an earlier ``fit``, is left as it is)."""
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        return
    # the children training_step calls get the root units (the LightningModule's own forward is
    # usually never called); a LightningModule with its own parameters too
    roots = [c for c in module.children() if any(True for _ in c.parameters())]
    if any(True for _ in module.parameters(recurse=False)) or not roots:
        roots.append(module)
    if shared_parameters(roots):  # a tied embedding and head: one unit for the module
        if not is_overridden("forward", module):
            raise ValueError(
                f"{type(module).__name__}'s children share parameters (e.g. a tied embedding and head), so they "
                "cannot each be an FSDP2 root unit, and the LightningModule itself has no forward to be the "
                "root: define forward and call self(...) in training_step"
            )
        roots = [module]
    plan.apply(module, meshes, root_units=roots)
