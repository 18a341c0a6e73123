"""Model libraries (Hugging Face ``transformers``, ...) as the package sees them: one interface, one registry.

The core and the Lightning layer never import a model library, nor the package's integration of one: they ask
the libraries registered here. Each integration (``lightning_ndclip/integrations/<library>/``) implements
:class:`ModelLibrary` and registers one instance when :mod:`lightning_ndclip` is imported; it imports its
library only once a model of it exists (a module holding such a model has imported the library already).

Every method has the answer for a module that holds none of the library's models (no models, an empty plan, no
split, nothing to do), so a library that is not installed is a library without models: only a feature that needs
one of its models raises (:func:`require_models`, naming the extra to install).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

if TYPE_CHECKING:
    from lightning_ndclip.core.pipeline import ModelSplit

__all__ = [
    "ExpertRouting",
    "block_classes",
    "LibraryModel",
    "ModelLibrary",
    "SequenceCut",
    "expert_routing",
    "library_of",
    "models",
    "outermost",
    "register",
    "registered",
    "require_models",
    "the_model",
]


class SequenceCut(NamedTuple):
    """A micro-batch cut along the sequence for this cp rank (:meth:`ModelLibrary.cut_batch`): the rank's part of the
    batch, the context the step runs in (the cut active for the library's models), and the losses those models
    returned in it (each their part of the micro-batch's mean; filled while the context is open)."""

    batch: Any
    active: AbstractContextManager[Any]
    model_losses: list[torch.Tensor]


class ExpertRouting(NamedTuple):
    """How a mixture-of-experts model routes (:meth:`ModelLibrary.expert_routing`): its expert count, the experts
    each token goes to, and its load-balancing loss's weight (``None`` where it names none)."""

    num_experts: int
    top_k: int
    coef: float | None


class ModelLibrary:
    """What the package asks of a model library about the models of it inside a module. Subclasses override what
    their library's models provide; the defaults are the answers for a module holding none of them."""

    name: str = ""
    """The library's import name (``"transformers"``), used in messages."""
    extra: str = ""
    """The package extra that installs it (``"hf"``: ``pip install 'lightning_ndclip[hf]'``)."""

    def installed(self) -> bool:
        """Whether the library can be imported (without importing it)."""
        try:
            return importlib.util.find_spec(self.name) is not None
        except ImportError:  # a finder that knows it is absent says so by raising
            return False

    def models(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        """The outermost models of this library inside ``module`` (itself included), with their names."""
        return []

    def block_names(self, model: nn.Module) -> Collection[str]:
        """The class names of ``model``'s repeated blocks (one of :meth:`models`): its FSDP2 units by default."""
        return ()

    # tensor and expert parallel: the models' own plans (``ParallelPlan(tp_plan="auto")``)
    def tp_plan(self, module: nn.Module, tp: int) -> dict[str, ParallelStyle]:
        """``{module name: ParallelStyle}`` for the models inside ``module`` on a ``tp`` mesh dim of size ``tp``."""
        return {}

    def ep_plan(self, module: nn.Module) -> dict[str, ParallelStyle]:
        """``{module name: ParallelStyle}`` putting whole experts of the models inside ``module`` on ``ep`` ranks."""
        return {}

    # context parallel: the models' attention over a sequence cut along cp
    def context_parallelize(self, model: nn.Module, cp: DeviceMesh) -> None:
        """Make ``model`` (one of :meth:`models`) attend over a sequence cut along ``cp``."""

    def context_summary(self, cp: int, kv_exchange: str) -> str:
        """How the models' sequences are cut over ``cp`` ranks and attended over, for the startup summary."""
        return ""

    def cut_batch(self, batch: Any, cp: DeviceMesh, kv_exchange: str) -> SequenceCut:
        """This cp rank's part of a micro-batch for models made context parallel (the batch as it is by default)."""
        return SequenceCut(batch, nullcontext(), [])

    # loss parallel: the LM heads and the models' own loss on vocabulary shards
    def output_heads(self, module: nn.Module) -> dict[str, nn.Module]:
        """``{head module name: model}``: the LM heads (output embeddings) of the models inside ``module``."""
        return {}

    def use_vocab_parallel_loss(self, model: nn.Module) -> None:
        """Make ``model``'s own loss the one computed on vocabulary-sharded logits."""

    def replay_loss_parallel(self, parallel: nn.Module, plain: nn.Module) -> None:
        """Give the models in ``plain`` (a one-process copy of ``parallel``) the loss function ``parallel``'s use."""

    # activation checkpointing and randomness
    def recompute_without_cache(self, module: nn.Module, recomputed: Collection[nn.Module]) -> None:
        """Make the ``recomputed`` (checkpointed) layers of the models inside ``module`` keep no inference cache."""

    def attention_dropout(self, model: nn.Module) -> float:
        """The probability with which ``model`` drops out attention probabilities."""
        return 0.0

    def fork_split_head_dropout(self, model: nn.Module, tp_rank: int) -> Callable[[], None]:
        """Make each tp rank draw the attention dropout of its own heads; returns the undo."""
        return lambda: None

    # mixture of experts
    def expert_routing(self, source: Any) -> ExpertRouting | None:
        """How ``source`` (a model of the library, or its config) routes, or ``None`` where it does not say."""
        return None

    # pipeline
    def pipeline_split(self, model: nn.Module) -> ModelSplit | None:
        """``model``'s own pipeline split, or ``None``."""
        return None

    # checkpoints
    def load_checkpoint(
        self, model: nn.Module, directory: Any, *, device: torch.device, held_elsewhere: Collection[str] = ()
    ) -> None:
        """Load the library's checkpoint ``directory`` into ``model``'s shards."""
        raise NotImplementedError(f"{type(self).__name__} loads no checkpoints")


def outermost(module: nn.Module, base_class: str) -> list[tuple[str, nn.Module]]:
    """The outermost instances inside ``module`` (itself included), with their names, of the class ``base_class``
    (``"transformers.modeling_utils:PreTrainedModel"``) if its module is imported, else none: a model of a library
    cannot exist before its model classes do, so a library that is not imported (or not installed) has no models,
    and nothing is imported to find that out."""
    where, _, name = base_class.partition(":")
    base = getattr(sys.modules.get(where), name, None)
    if base is None:
        return []
    if isinstance(module, base):  # itself: nothing inside it is outermost (library_of asks this of every model)
        return [("", module)]
    found: list[tuple[str, nn.Module]] = []
    for child_name, child in module.named_modules():
        if isinstance(child, base) and not any(child_name.startswith(f"{outer}.") or not outer for outer, _ in found):
            found.append((child_name, child))
    return found


class LibraryModel(NamedTuple):
    """A model of a registered library found inside a module: its name there, the model, its library."""

    name: str
    model: nn.Module
    library: ModelLibrary


_REGISTERED: list[ModelLibrary] = []


def register(library: ModelLibrary) -> None:
    """Register ``library`` (once per class: an integration imported twice registers once)."""
    if not any(type(known) is type(library) for known in _REGISTERED):
        _REGISTERED.append(library)


def registered() -> tuple[ModelLibrary, ...]:
    """The registered libraries, in the order they were registered."""
    return tuple(_REGISTERED)


def models(module: nn.Module) -> list[LibraryModel]:
    """The models of every registered library inside ``module``."""
    return [LibraryModel(name, model, library) for library in _REGISTERED for name, model in library.models(module)]


def require_models(module: nn.Module, feature: str, needs: str) -> list[LibraryModel]:
    """:func:`models` of ``module``, which ``feature`` needs (at least one).

    Raises:
        ImportError: no model found and a registered library is not installed: naming the extras to install.
        ValueError: no model found, every library installed: naming ``feature`` and what it ``needs`` instead.
    """
    found = models(module)
    if found:
        return found
    missing = [library for library in _REGISTERED if not library.installed()]
    present = " or ".join(library.name for library in _REGISTERED if library.installed()) or "any installed library"
    held = f"{feature}: {type(module).__name__} holds no model of {present}"
    if missing:
        names = " or ".join(library.name for library in missing)
        extras = ", ".join(f"pip install 'lightning_ndclip[{library.extra}]'" for library in missing)
        raise ImportError(f"{held}, and {names} is not installed (a model of it needs it): {extras}")
    raise ValueError(f"{held}; {needs}")


def the_model(module: nn.Module, feature: str, instead: str) -> LibraryModel:
    """The one model of a registered library inside ``module``, which ``feature`` works on.

    Raises:
        ValueError: none or several, naming them and what to do ``instead``.
    """
    found = models(module)
    if len(found) != 1:
        names = [f"{m.name or '(the module)'}: {type(m.model).__name__}" for m in found]
        raise ValueError(
            f"{feature} works on the one library model (transformers, ...) of the module; {type(module).__name__} "
            f"holds {len(found)} ({names}). {instead}"
        )
    return found[0]


def block_classes(module: nn.Module) -> tuple[type[nn.Module], ...]:
    """The classes of the repeated blocks of the library models inside ``module`` (their decoder layers, transformer
    blocks), as their libraries name them, in the order they first occur; none where ``module`` holds no such model."""
    found: dict[type[nn.Module], None] = {}
    for _, model, library in models(module):
        names = set(library.block_names(model))
        found.update((type(m), None) for m in model.modules() if type(m).__name__ in names)
    return tuple(found)


def expert_routing(source: Any) -> ExpertRouting | None:
    """How ``source`` (a model or a config) routes, as the first registered library that reads it says."""
    return next((r for r in (library.expert_routing(source) for library in _REGISTERED) if r is not None), None)


def library_of(model: nn.Module) -> ModelLibrary | None:
    """The registered library ``model`` is a model of (it is its own outermost model), or ``None``."""
    return next((library for library in _REGISTERED if any(m is model for _, m in library.models(model))), None)
