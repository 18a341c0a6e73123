"""A step's random draws, recorded on the ranks and replayed on one device.

A step that draws random numbers (dropout masks, noise) computes ``f(x, r)`` with ``r`` its draws. To check it
against one device, one device must compute ``f(x, r')`` with ``r'`` *the same numbers*: the draws of the ranks
holding the same samples (tensor-parallel and context-parallel peers), put together as one device would hold them.
Re-seeding cannot give them: one device draws the whole tensor from one stream, each rank its part from its own.

:class:`RandomDraws` is a dispatch mode that sees every op tagged ``torch.Tag.nondeterministic_seeded``:

* **recording** (``RandomDraws()``): it runs the op unchanged and appends its random result, in call order, as a
  CPU copy: the returned tensor of a functional draw (``torch.rand``, ``randn``, ``randint``, ``randperm``,
  ``multinomial``, ``normal``, ``bernoulli``...), the tensor after the op of an in-place one (``bernoulli_``,
  ``uniform_``, ``normal_``, ``exponential_``...), the mask of ``native_dropout``. ``F.dropout`` is
  ``empty_like(x).bernoulli_(1 - p)`` on the CPU and ``native_dropout`` on CUDA: a mask either way (0 / 1 values,
  or booleans). Recording changes no value and draws nothing more: the generators end where they would have.
* **replaying** (``RandomDraws(replay=sources)``): draw ``j`` is the ``j``-th source instead, for the shape the
  replay asks: ``native_dropout`` returns ``(input * mask / (1 - p), mask)`` in the input's dtype; an in-place draw
  copies it into ``self``; any other draw runs once, for its result's shape, dtype and device, and is overwritten
  (cast to its dtype). So a mask recorded on CUDA replays on the CPU's ``bernoulli_``, and the other way round.
  Asking for more draws than recorded, fewer, or a shape the source cannot give raises :class:`NotReplayable`.

Draws the mode cannot stand in for are not replayed but named (``RandomDraws.unsupported`` when recording,
:class:`NotReplayable` when replaying): a draw on a ``DTensor`` (its random numbers come from DTensor's own
offsets, per shard), and kernels that draw inside (attention or RNN kernels with a dropout probability above 0,
``rrelu`` in training, ``_fused_dropout``). Attention kernels with no dropout carry the tag too: they are no draw.

:func:`assemble` makes one device's draw from the ranks' draws of the same samples, for the shape one device asks:
every piece of that shape and equal: that tensor (the peers drew alike, as they must for replicated activations);
of that shape but different: :class:`PeersDrewApart` (the peers computed different functions: no one device's step);
pieces short along exactly one dim whose sizes add up to it (each tp rank's heads): concatenated along it in rank
order; anything else: :class:`NotReplayable`. :func:`assemble_peers` does it over tp peers, then over cp peers
(whose draws must be equal: a draw split over the sequence is not replayable).

Guarantees: recording is transparent (the same values, the generators where they would be); a replay that returns
draws its ``training_step`` from exactly the recorded numbers, in call order, cast to the dtype it asks for, or it
raises (another count, another shape, a draw it cannot replay): never a silent fresh draw. A replay still runs a
functional draw once for its result's layout, advancing the generators: run it inside ``torch.random.fork_rng`` to
leave them as they were. Compiled code runs compiled under the mode (``ignore_compile_internals``): its draws are
not recorded, and a replay that asks for them raises. Pure PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.fx.operator_schemas import normalize_function

from lightning_ndclip._compat import DispatchMode, tree_leaves

__all__ = ["NotReplayable", "PeersDrewApart", "RandomDraws", "Source", "assemble", "assemble_peers"]

Source = torch.Tensor | Callable[[torch.Size], torch.Tensor]
"""One recorded draw for a replay: the tensor, or a function of the shape the replay asks that returns it."""


class NotReplayable(ValueError):
    """The recorded draws cannot stand in for the replay's: another number of draws, shapes that do not fit, a draw
    the mode cannot replay."""


class PeersDrewApart(ValueError):
    """Ranks holding the same samples drew different numbers for a tensor they all hold whole."""


_NO, _DRAW, _DROPOUT, _KERNEL = 0, 1, 2, 3
"""What an op is to the mode: no draw; a draw with one random tensor as result; native_dropout; a kernel drawing
inside (a draw only with a dropout probability above 0 or in training)."""

_KINDS: dict[Any, int] = {}
_KERNEL_WORDS = ("attention", "rnn", "lstm", "gru", "rrelu", "dropout")


def _kind(func: Any) -> int:
    """What ``func`` (an ``OpOverload``) is to the mode, cached per op."""
    kind = _KINDS.get(func)
    if kind is None:
        if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):  # a higher-order operator has none
            kind = _NO
        elif func is torch.ops.aten.native_dropout.default:
            kind = _DROPOUT
        else:
            kind = _KERNEL if any(word in func.overloadpacket.__name__ for word in _KERNEL_WORDS) else _DRAW
        _KINDS[func] = kind
    return kind


def _kernel_draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a kernel that may draw (attention, RNN, rrelu) draws in this call: a dropout probability above 0, or
    training, where its arguments say; when they do not, it is taken to draw."""
    if "no_dropout" in func.overloadpacket.__name__:
        return False
    try:
        normalized = normalize_function(func, args, kwargs, normalize_to_only_use_kwargs=True)
    except Exception:  # arguments it cannot match to the schema: taken to draw
        normalized = None
    named = normalized.kwargs if normalized is not None else {}
    if any(named.get(key) is False for key in ("train", "training")):
        return False
    probability = next((named[k] for k in ("dropout_p", "dropout") if isinstance(named.get(k), (int, float))), None)
    return probability is None or float(probability) > 0.0


def _shape(size: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(s) for s in size)


class RandomDraws(DispatchMode):
    """Record the random draws of the ops run inside (``RandomDraws()``), or replay recorded ones
    (``RandomDraws(replay=sources)``); see the module docstring.

    Args:
        replay: the draws to return, in call order: tensors, or functions of the shape the replay asks (as
            :func:`assemble_peers` with its pieces bound). ``None``: record.
        label: where the draws belong, for the errors (``"data rank 0, micro-batch 1"``).

    Attributes:
        draws: the recorded draws, CPU copies in call order.
        unsupported: what was drawn that cannot be replayed (op and why), in call order.
        used: how many draws the replay has returned.
    """

    supports_higher_order_operators = True
    """Higher-order operators (``flex_attention``...) pass through (else torch refuses them under a mode); draws inside
    one are not seen."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compiled code runs compiled, its ops unseen (``flex_attention`` compiles itself and fails under a mode that
        does not ignore it): its draws are not recorded, and a replay that asks for them is :class:`NotReplayable`."""
        return True

    def __init__(self, replay: Sequence[Source] | None = None, label: str = "") -> None:
        super().__init__()
        self.sources = replay
        self.label = label
        self.draws: list[torch.Tensor] = []
        self.unsupported: list[str] = []
        self.used = 0

    @property
    def replaying(self) -> bool:
        return self.sources is not None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = _kind(func)
        if kind == _NO or (kind == _KERNEL and not _kernel_draws(func, args, kwargs)):
            return func(*args, **kwargs)
        if kind == _DROPOUT and len(args) > 2 and args[2] is False:  # native_dropout(train=False): no draw
            return func(*args, **kwargs)
        problem = ""
        if any(isinstance(t, DTensor) for t in tree_leaves((args, kwargs))):
            problem = f"{func} on a DTensor (its numbers come from DTensor's own offsets, per shard)"
        elif kind == _KERNEL:
            problem = f"{func} (a kernel that draws its random numbers inside)"
        if self.sources is not None:
            if problem:
                raise NotReplayable(f"{self._where()}{problem}: not replayable")
            return self._replayed(func, kind, args, kwargs)
        out = func(*args, **kwargs)
        random = out[1] if kind == _DROPOUT else out
        if problem or not isinstance(random, torch.Tensor):
            self.unsupported.append(problem or f"{func} (its result is no single tensor)")
        else:
            self.draws.append(random.detach().to("cpu", copy=True))
        return out

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        super().__exit__(exc_type, exc_val, exc_tb)
        if exc_type is None and self.sources is not None and self.used < len(self.sources):
            raise NotReplayable(
                f"{self._where()}the replay drew {self.used} random tensor(s) where the parallel step drew "
                f"{len(self.sources)}"
            )

    def _where(self) -> str:
        return f"{self.label}: " if self.label else ""

    def _replayed(self, func: Any, kind: int, args: tuple, kwargs: dict) -> Any:
        """The op's result with draw ``used`` in place of its random numbers."""
        assert self.sources is not None
        index = self.used
        if index >= len(self.sources):
            raise NotReplayable(
                f"{self._where()}the replay draws more random tensors than the parallel step did ({len(self.sources)}): "
                f"draw {index + 1} is {func}"
            )
        self.used += 1
        if kind == _DROPOUT:
            inputs, p = args[0], float(args[1])
            mask = self._value(index, func, inputs.shape).to(inputs.device, torch.bool)
            return inputs * mask * (1.0 / (1.0 - p) if p < 1.0 else 0.0), mask
        if func.overloadpacket.__name__.endswith("_"):  # in place: nothing drawn, self overwritten
            return args[0].copy_(self._value(index, func, args[0].shape))
        out = func(*args, **kwargs)  # for its shape, dtype and device
        if not isinstance(out, torch.Tensor):
            raise NotReplayable(f"{self._where()}{func} returns no single tensor: not replayable")
        return out.copy_(self._value(index, func, out.shape))

    def _value(self, index: int, func: Any, shape: torch.Size) -> torch.Tensor:
        """Source ``index`` for ``shape``, its errors prefixed with where and which draw it is."""
        assert self.sources is not None
        source = self.sources[index]
        where = f"{self.label}, " if self.label else ""
        try:
            value = source if isinstance(source, torch.Tensor) else source(torch.Size(shape))
        except (NotReplayable, PeersDrewApart) as error:
            raise type(error)(f"{where}random draw {index + 1} ({func}): {error}") from error
        if value.shape != shape:
            raise NotReplayable(
                f"{where}random draw {index + 1} ({func}): the replay asks for shape {_shape(shape)}, the parallel "
                f"step drew {_shape(value.shape)}"
            )
        return value


def assemble(pieces: Sequence[torch.Tensor], shape: Sequence[int], peers: str = "tp") -> torch.Tensor:
    """One device's draw of ``shape`` from the draws of the ranks holding the same samples, in ``peers`` rank order.

    All of ``shape`` and equal: that tensor. All of ``shape`` but different: :class:`PeersDrewApart`. Of ``shape`` but
    shorter along one dim, their sizes along it adding up to it: concatenated along it. Else :class:`NotReplayable`.
    """
    size = torch.Size(_shape(shape))
    if not pieces:
        raise NotReplayable("no draw to assemble")
    if all(p.shape == size for p in pieces):
        for rank, piece in enumerate(pieces[1:], 1):
            if not torch.equal(piece, pieces[0]):
                differ = float((piece != pieces[0]).double().mean())
                raise PeersDrewApart(
                    f"the {peers} ranks 0 and {rank} drew different random numbers ({differ:.0%} of them) for a tensor "
                    f"of shape {_shape(size)} that each holds whole: the ranks holding the same samples must draw it alike"
                )
        return pieces[0]
    if all(p.dim() == len(size) for p in pieces):
        dims = {d for p in pieces for d in range(len(size)) if p.shape[d] != size[d]}
        if len(dims) == 1:
            dim = dims.pop()
            if sum(p.shape[dim] for p in pieces) == size[dim]:
                return torch.cat(list(pieces), dim=dim)
    raise NotReplayable(
        f"the {peers} ranks drew shapes {[_shape(p.shape) for p in pieces]} where one device draws {_shape(size)}"
    )


def assemble_peers(groups: Sequence[Sequence[torch.Tensor]], shape: Sequence[int]) -> torch.Tensor:
    """One device's draw of ``shape`` from ``groups[c][t]``, the draw of the rank with cp rank ``c`` and tp rank ``t``
    (of one data rank and stage): :func:`assemble` over each cp rank's tp peers; the cp ranks' must be equal and of
    ``shape`` (a draw split over the sequence is :class:`NotReplayable`; equal shapes, other numbers:
    :class:`PeersDrewApart`)."""
    whole = []
    for tp_pieces in groups:
        try:
            whole.append(assemble(tp_pieces, shape))
        except NotReplayable as error:
            if len(groups) > 1:
                raise NotReplayable(f"a draw split over cp (not replayable): {error}") from error
            raise
    for rank, value in enumerate(whole[1:], 1):
        if not torch.equal(value, whole[0]):
            raise PeersDrewApart(
                f"the cp ranks 0 and {rank} drew different random numbers for a tensor of shape {_shape(shape)} that "
                "each holds whole (a per-sample value): the ranks holding the same samples must draw it alike"
            )
    return whole[0]
