"""PyTorch's own gradient-clipping tests, run on torch's functions and on ours: ``lightning_ndclip``'s
``clip_grad_norm_`` / ``get_total_norm`` / ``clip_grads_with_norm_`` are drop-ins for
``torch.nn.utils``'s, so the same bodies, assertions and inputs must pass with both.

Ported from PyTorch (https://github.com/pytorch/pytorch, BSD-3-Clause license, Copyright (c) the
PyTorch contributors; the license's notice applies to the ported bodies):

* ``test/test_nn.py``, ``TestNNDeviceType``: ``test_clip_grad_norm`` (every ``norm_type`` x
  ``foreach``), ``test_clip_grad_norm_error_if_nonfinite``, ``test_clip_grad_norm_multi_device``
  (``foreach`` x 2);
* ``test/distributed/_composable/fsdp/test_fully_shard_clip_grad_norm_.py``:
  ``TestClipGradNormWorldSize2.test_clip_grad_norm_1d`` (FSDP2, 2 ranks) and
  ``TestClipGradNormWorldSize4.test_clip_grad_norm_2d`` (FSDP2 x TP, 4 ranks), sharing
  ``_TestClipGradNormBase._test_clip_grad_norm``.

What changed, and only that:

* the implementation is a parameter (``impl``: torch's three functions, or ours); the bodies call
  the names ``clip_grad_norm_`` / ``get_total_norm`` / ``clip_grads_with_norm_`` bound to it (the FSDP
  tests' reference model keeps ``torch.nn.utils.clip_grad_norm_``, the baseline both are held to);
* CPU and gloo: ``device`` is ``"cpu"``; the FSDP tests run on the worker pool of ``harness.py``
  (2 and 4 ranks) instead of ``FSDPTest``'s spawned processes; ``test_clip_grad_norm_multi_device``
  runs on ``("cpu", "cpu")`` (the body unchanged: two "devices" that are one), and on two CUDA
  devices where there are (skipped otherwise);
* no private torch names: ``p._grad = g`` is ``p.grad = g``; ``replicate(model, ...)`` is
  ``DistributedDataParallel(model, ...)`` (the same averaged gradients); the internal test models
  (``common_dtensor.Transformer``, ``common_fsdp.MLPStack``) are small equivalents below with
  the same structure, sizes and parallelization; ``TestCase.assertEqual`` is :class:`_Case`'s, on
  ``torch.testing.assert_close`` (tensor dtypes checked, the dtype's default tolerances);
* the 2-D FSDP test computes in float64, from the same values (torch's float32 parameters and input,
  cast): on CPU, float32 tensor-parallel sums make the sharded gradients' L1 norm differ from the
  unsharded one by 3.7e-6 relative, above the float32 tolerance of ``assertEqual`` (1.3e-6), with
  torch's own functions as with ours;
* the FSDP tests run 2 iterations instead of 10 (the second clips gradients after an Adam step; the whole
  file runs in seconds on 2 cores), and
  their count of all-reduces is the implementation's: torch does one per mesh dim of its total
  (``c10d_functional.all_reduce``); ours one in all (``c10d.allreduce_``). Ours gets a fresh
  ``NormPlans`` per test there, so that this count does not depend on which tests ran before in the
  same worker (a first call with a new layout after others joins one probe all-reduce, ``_probe``);
* one assertion is added after ``test_clip_grad_norm``'s body: the warning points at the caller.

Below them, this package's own tests: exactness of the norm types ``p <= 0`` and ``0.5`` on FSDP2 (2
ranks) and FSDP2 x TP (4 ranks) in float64 against torch's function on the plain model's gradients
on one process, with naive per-rank alternatives that fail the same check; empty shards; no host
reads for the new norm types; where the empty-generator warning comes; and totals passed between
the two implementations' ``clip_grads_with_norm_``, and on two meshes (where torch raises).
"""

from __future__ import annotations

import copy
import functools
import math
import unittest
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import product
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from harness import run_on_ranks
from torch import inf, nan
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

import lightning_ndclip as nd

# --- the implementations ------------------------------------------------------------------------


@dataclass(frozen=True)
class Impl:
    """The three functions of one implementation, and what one ``clip_grad_norm_`` of DTensor
    gradients costs it in all-reduces (as ``CommDebugMode`` counts them)."""

    name: str
    clip_grad_norm_: Callable[..., torch.Tensor]
    get_total_norm: Callable[..., torch.Tensor]
    clip_grads_with_norm_: Callable[..., None]
    all_reduce_op: Any
    all_reduces: Callable[[torch.Tensor], int] = field(repr=False)

    @property
    def functions(self) -> tuple[Callable[..., Any], ...]:
        return self.clip_grad_norm_, self.get_total_norm, self.clip_grads_with_norm_


IMPLS = ("torch", "ndclip")


def make_impl(name: str, plans: nd.NormPlans | None = None) -> Impl:
    if name == "torch":
        u = torch.nn.utils
        return Impl(
            "torch", u.clip_grad_norm_, u.get_total_norm, u.clip_grads_with_norm_,
            torch.ops.c10d_functional.all_reduce, lambda total_norm: len(total_norm.placements),
        )
    bind = functools.partial if plans is not None else (lambda f, **_: f)
    return Impl(
        "ndclip",
        bind(nd.clip_grad_norm_, plans=plans),
        bind(nd.get_total_norm, plans=plans),
        bind(nd.clip_grads_with_norm_, plans=plans),
        torch.ops.c10d.allreduce_,
        lambda total_norm: 1,
    )


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> Impl:
    return make_impl(request.param)


class _Case(unittest.TestCase):
    """The assertions of torch's ``TestCase`` that the ported bodies use, on public torch only:
    ``assertEqual`` compares tensors (and a tensor with a number) as ``torch.testing.assert_close``
    does, with the dtype's default tolerances and the dtypes checked between two tensors, and
    sequences element by element."""

    __test__ = False  # a helper, not a unittest case for pytest to collect

    def __init__(self, world_size: int = 1) -> None:
        super().__init__()
        self.world_size = world_size

    def assertEqual(self, first: Any, second: Any, msg: Any = None) -> None:  # noqa: N802 - unittest's name
        if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)):
            super().assertEqual(len(first), len(second), msg)
            for a, b in zip(first, second):
                self.assertEqual(a, b, msg)
        elif isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
            both = isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)
            like = first if isinstance(first, torch.Tensor) else second
            a, b = (torch.as_tensor(x, dtype=None if both else like.dtype, device=like.device) for x in (first, second))
            torch.testing.assert_close(a, b, check_dtype=both, equal_nan=True, msg=None if msg is None else str(msg))
        else:
            super().assertEqual(first, second, msg)


@pytest.fixture
def case() -> _Case:
    return _Case()


# --- test/test_nn.py ----------------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", (0.5, 1.5, 2, 4, "inf"))
@pytest.mark.parametrize("foreach", (False, True))
def test_clip_grad_norm(case: _Case, impl: Impl, norm_type, foreach):
    self, device = case, "cpu"
    clip_grad_norm_, get_total_norm, clip_grads_with_norm_ = impl.functions
    # --- the body of test_nn.py's TestNNDeviceType.test_clip_grad_norm (p._grad -> p.grad) ---
    l = nn.Linear(10, 10).to(device)  # noqa: E741 - torch's name
    max_norm = 2

    def compute_norm(norm_type):
        norm_type = float(norm_type)
        if norm_type != inf:
            total_norm = 0
            for p in l.parameters():
                total_norm += p.grad.data.abs().pow(norm_type).sum()
            return pow(total_norm, 1. / norm_type)
        else:
            return max(p.grad.data.abs().max() for p in l.parameters())

    def compare_scaling(grads):
        p_scale = [p.grad.data.div(g).view(-1) for p, g in zip(l.parameters(), grads)]
        scale = torch.cat(p_scale)
        self.assertEqual(scale.std(), 0)
        return scale[0]

    grads = torch.arange(1., 101, device=device).view(10, 10), torch.ones(10, device=device).div(1000)
    for p, g in zip(l.parameters(), grads):
        p.grad = g.clone().view_as(p.data)
    norm_before = compute_norm(norm_type)
    norm = clip_grad_norm_(l.parameters(), max_norm, norm_type=norm_type, foreach=foreach)
    norm_after = compute_norm(norm_type)
    self.assertEqual(norm, norm_before)
    self.assertEqual(norm_after, max_norm)
    self.assertLessEqual(norm_after, norm_before)
    compare_scaling(grads)

    # decomposed APIs should behave as expected
    grads = torch.arange(1., 101, device=device).view(10, 10), torch.ones(10, device=device).div(1000)
    for p, g in zip(l.parameters(), grads):
        p.grad = g.clone().view_as(p)
    norm_before = compute_norm(norm_type)
    grads = [p.grad for p in l.parameters()]
    total_norm = get_total_norm(grads, norm_type=norm_type, foreach=foreach)
    clip_grads_with_norm_(l.parameters(), max_norm, total_norm, foreach=foreach)
    norm_after = compute_norm(norm_type)
    self.assertEqual(total_norm, norm_before)
    self.assertEqual(norm_after, max_norm)
    self.assertLessEqual(norm_after, norm_before)
    compare_scaling(grads)

    # Small gradients should be left unchanged
    grads = torch.rand(10, 10, device=device).div(10000), torch.ones(10, device=device).div(500)
    for p, g in zip(l.parameters(), grads):
        p.grad.data.copy_(g)
    norm_before = compute_norm(norm_type)
    norm = clip_grad_norm_(l.parameters(), max_norm, norm_type=norm_type, foreach=foreach)
    norm_after = compute_norm(norm_type)
    self.assertEqual(norm, norm_before)
    self.assertEqual(norm_before, norm_after)
    self.assertLessEqual(norm_after, max_norm)
    scale = compare_scaling(grads)
    self.assertEqual(scale, 1)

    # Should accept a single Tensor as input
    p1, p2 = torch.randn(10, 10, device=device), torch.randn(10, 10, device=device)
    g = torch.arange(1., 101, device=device).view(10, 10)
    p1.grad = g.clone()
    p2.grad = g.clone()
    clip_grad_norm_(p1, max_norm, norm_type=norm_type, foreach=foreach)
    clip_grad_norm_([p2], max_norm, norm_type=norm_type, foreach=foreach)
    self.assertEqual(p1.grad, p2.grad)

    # Should warning when parameters generator exhausted
    params = l.parameters()
    for p in params:  # noqa: B007 - torch's body
        pass
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=foreach)
        self.assertEqual(len(w), 1)
        self.assertEqual(str(w[0].message), "`parameters` is an empty generator, no gradient clipping will occur.")
    # --- end of the body ---
    assert w[0].filename == __file__, "the warning should point at the caller, as torch's"


def test_clip_grad_norm_error_if_nonfinite(case: _Case, impl: Impl):
    self, device = case, "cpu"
    clip_grad_norm_ = impl.clip_grad_norm_
    # --- the body of test_nn.py's TestNNDeviceType.test_clip_grad_norm_error_if_nonfinite ---
    norms_pos = [0.1, 1, 2, 3.5, inf]
    norms_neg = [-0.1, -1, -2, -3.5]
    norms_except_0 = norms_pos + norms_neg
    norms_all = norms_except_0 + [0]

    # Each entry in test_cases has the following values, in this order:
    #
    # grad_only_one_elem    If True, only one element of the parameter's
    #                       gradient is set to the scalar grad, and the
    #                       rest of the elements are 0. If False, all grad
    #                       elements are equal to the scalar.
    #
    # prefix_finite_grad_param  If True, prefix a parameter that has a grad
    #                           of 1.
    #
    # scalars           Scalars to use as the parameter's grad, through
    #                   multiplication
    #
    # norms_nonfinite   Norm types that should produce nonfinite total norm
    #
    # norms_finite      Norm types that should produce finite total norm
    test_cases = [
        # Test errors from an infinite grad
        (False, False, [inf, -inf], norms_except_0, [0]),
        (False, True, [inf, -inf], norms_pos, norms_neg + [0]),
        (True, False, [inf, -inf], norms_pos, norms_neg + [0]),
        (True, True, [inf, -inf], norms_pos, norms_neg + [0]),

        # Test errors from a NaN grad
        (False, False, [nan], norms_except_0, [0]),
        (False, True, [nan], norms_except_0, [0]),
        (True, False, [nan], norms_except_0, [0]),
        (True, True, [nan], norms_except_0, [0]),

        # Test a grad that should never error
        (False, False, [2e22, -2e22], [], norms_all),
        (False, True, [2e22, -2e22], [], norms_all),
        (True, False, [2e22, -2e22], [], norms_all),
        (True, True, [2e22, -2e22], [], norms_all),

        # Test a grad that will overflow to inf for only some norm orders
        (False, False, [2e200, -2e200], [3.5, 2, -2, -3.5], [inf, 1, 0.1, 0, -1, -0.1]),
        (False, True, [2e200, -2e200], [3.5, 2], norms_neg + [inf, 1, 0.1, 0]),
        (True, False, [2e200, -2e200], [3.5, 2], norms_neg + [inf, 1, 0.1, 0]),
        (True, True, [2e200, -2e200], [3.5, 2], norms_neg + [inf, 1, 0.1, 0]),
    ]

    def gen_parameters(scalar, grad_only_one_elem, prefix_finite_grad_param):
        param = torch.ones(10, dtype=torch.float64, device=device, requires_grad=True)

        if grad_only_one_elem:
            param[1].mul(scalar).sum().backward()
        else:
            param.mul(scalar).sum().backward()

        if prefix_finite_grad_param:
            prefix_param = torch.ones(1, dtype=torch.float64, device=device, requires_grad=True)
            prefix_param.mul(1).sum().backward()
            parameters = [prefix_param, param]
        else:
            parameters = [param]

        return parameters

    def run_test_case(norm_type, error_if_nonfinite, scalar, grad_only_one_elem, prefix_finite_grad_param, is_norm_nonfinite):
        msg = (
            f'norm_type: {norm_type}, ',
            f'error_if_nonfinite: {error_if_nonfinite}, '
            f'scalar: {scalar}, '
            f'grad_only_one_elem: {grad_only_one_elem}, '
            f'prefix_finite_grad_param: {prefix_finite_grad_param}, '
            f'is_norm_nonfinite: {is_norm_nonfinite}')

        parameters = gen_parameters(scalar, grad_only_one_elem, prefix_finite_grad_param)

        # Should only throw an error if the total norm is expected to be
        # nonfinite and `error_if_nonfinite=True`
        if is_norm_nonfinite and error_if_nonfinite:
            error_msg = f'The total norm of order {float(norm_type)} for gradients'

            grads_before = [p.grad.clone() for p in parameters]

            with self.assertRaisesRegex(RuntimeError, error_msg, msg=msg):
                clip_grad_norm_(parameters, 1, norm_type=norm_type, error_if_nonfinite=True)

            # Grad should not change if error is thrown
            grads_after = [p.grad for p in parameters]
            self.assertEqual(grads_before, grads_after, msg=msg)
        else:
            clip_grad_norm_(parameters, 1, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)

    for grad_only_one_elem, prefix_finite_grad_param, scalars, norms_nonfinite, norms_finite in test_cases:
        for error_if_nonfinite in [False, True]:
            for norm_type, scalar in product(norms_nonfinite, scalars):
                run_test_case(norm_type, error_if_nonfinite, scalar, grad_only_one_elem, prefix_finite_grad_param, True)

            for norm_type, scalar in product(norms_finite, scalars):
                run_test_case(norm_type, error_if_nonfinite, scalar, grad_only_one_elem, prefix_finite_grad_param, False)


_TWO_CUDA = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.mark.parametrize("devices", [("cpu", "cpu"), pytest.param(("cuda:0", "cuda:1"), marks=_TWO_CUDA)])
@pytest.mark.parametrize("foreach", (False, True))
def test_clip_grad_norm_multi_device(case: _Case, impl: Impl, devices, foreach):
    self = case
    clip_grad_norm_ = impl.clip_grad_norm_
    # --- the body of test_nn.py's TestNNDeviceType.test_clip_grad_norm_multi_device ---
    class TestModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer1 = nn.Linear(10, 10)
            self.layer2 = nn.Linear(10, 10)

    test_model = TestModel()
    test_model.layer1.to(devices[0])
    test_model.layer2.to(devices[1])
    ref_model = TestModel().to(devices[0])
    for norm_type in [2., math.inf]:
        for p in test_model.parameters():
            p.grad = torch.ones_like(p)
        for p in ref_model.parameters():
            p.grad = torch.ones_like(p)
        norm = clip_grad_norm_(test_model.parameters(), 0.5, norm_type=norm_type, foreach=foreach)
        expected = clip_grad_norm_(ref_model.parameters(), 0.5, norm_type=norm_type, foreach=foreach)
        self.assertEqual(norm, expected)
        for p, pe in zip(test_model.parameters(), ref_model.parameters()):
            self.assertEqual(p.grad.to(devices[0]), pe.grad)


# --- models equivalent to torch's internal test models ----------------------------------------


@dataclass
class ModelArgs:
    """``common_dtensor.ModelArgs``'s defaults."""

    n_layers: int = 2
    vocab_size: int = 8
    max_seq_len: int = 16
    dim: int = 16
    n_heads: int = 4
    dropout_p: float = 0.1
    use_attn_mask: bool = True
    weight_tying: bool = True


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.dropout_p = args.n_heads, args.dim // args.n_heads, args.dropout_p
        self.use_attn_mask = args.use_attn_mask
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim) for _ in range(4))
        self.resid_dropout = nn.Dropout(args.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.size()
        q, k, v = (w(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout_p if self.training else 0, is_causal=self.use_attn_mask
        )
        return self.resid_dropout(self.wo(out.transpose(1, 2).contiguous().view(bsz, seq_len, -1)))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout_p: float) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden_dim), nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.w2(F.gelu(self.w1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(args.dim), nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """``common_dtensor.Transformer``: token and position embeddings, pre-norm blocks, a tied output."""

    def __init__(self, model_args: ModelArgs) -> None:
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.pos_embeddings = nn.Embedding(model_args.max_seq_len, model_args.dim)
        self.dropout = nn.Dropout(model_args.dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(model_args) for _ in range(model_args.n_layers))
        self.norm = nn.LayerNorm(model_args.dim)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        if model_args.weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.size(1), device=tokens.device))
        h = self.dropout(h)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()


class MLP(nn.Module):
    """``common_fsdp.MLP``."""

    def __init__(self, dim: int, *, bias: bool = True, dim_multiplier: int = 4) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim_multiplier * dim, bias=bias)
        self.out_proj = nn.Linear(dim_multiplier * dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.out_proj(F.relu(self.in_proj(x))))


class MLPStack(nn.Sequential):
    """``common_fsdp.MLPStack``: three MLPs (multipliers 3, 4, 3: uneven shards), a LayerNorm with
    sequence parallelism; ``parallelize`` applies the same TP plan and FSDP units."""

    def __init__(self, mlp_dim: int, *, with_seq_parallel: bool = False) -> None:
        modules: list[nn.Module] = [MLP(mlp_dim, dim_multiplier=3), MLP(mlp_dim), MLP(mlp_dim, dim_multiplier=3)]
        if with_seq_parallel:
            modules.append(nn.LayerNorm(mlp_dim, bias=False))
        super().__init__(*modules)
        self.with_seq_parallel = with_seq_parallel

    def parallelize(self, tp_mesh: DeviceMesh, dp_mesh: DeviceMesh, use_activation_checkpointing: bool, **fsdp_kwargs):
        assert not use_activation_checkpointing, "not needed here (torch's uses a private checkpoint)"
        parallelize_plan = {
            "0.in_proj": ColwiseParallel(use_local_output=False),
            "0.out_proj": RowwiseParallel(use_local_output=False),
            "1.in_proj": ColwiseParallel(use_local_output=False),
            "1.out_proj": RowwiseParallel(use_local_output=False),
            "2.in_proj": ColwiseParallel(use_local_output=False),
            "2.out_proj": RowwiseParallel(output_layouts=Shard(1)) if self.with_seq_parallel else RowwiseParallel(),
        }
        if self.with_seq_parallel:
            parallelize_plan["3"] = SequenceParallel(sequence_dim=1)
        parallelize_module(self, device_mesh=tp_mesh, parallelize_plan=parallelize_plan)
        for module in self:
            if isinstance(module, nn.LayerNorm):
                continue
            fully_shard(module, mesh=dp_mesh, **fsdp_kwargs)
        fully_shard(self, mesh=dp_mesh, **fsdp_kwargs)
        return self


# --- test/distributed/_composable/fsdp/test_fully_shard_clip_grad_norm_.py ----------------------

_ITERATIONS = 2  # torch's: 10
device_type = torch.device("cpu")


class _TestClipGradNormBase(_Case):
    """``_TestClipGradNormBase`` and its two test classes, run on every rank of a harness pool."""

    def __init__(self, impl: Impl, world_size: int) -> None:
        super().__init__(world_size)
        self.impl = impl

    def _test_clip_grad_norm(
        self,
        max_norm: float | int,
        norm_type: float | int,
        ref_model: nn.Module,
        ref_optim: torch.optim.Optimizer,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        inp: torch.Tensor,
        dp_mesh: DeviceMesh | None = None,
    ):
        clip_grad_norm_ = self.impl.clip_grad_norm_
        vector_norm_fn = functools.partial(torch.linalg.vector_norm, ord=norm_type)
        dp_mesh = dp_mesh or init_device_mesh(device_type.type, (self.world_size,))
        torch.manual_seed(42 + dp_mesh.get_local_rank() + 1)
        for _ in range(_ITERATIONS):
            ref_optim.zero_grad()
            ref_model(inp).sum().backward()
            optim.zero_grad()
            model(inp).sum().backward()

            ref_grads = [p.grad.detach().clone() for p in ref_model.parameters()]
            local_grads = [
                p.grad.to_local().detach().clone() for p in model.parameters()
            ]
            for ref_grad, param in zip(ref_grads, model.parameters()):
                self.assertEqual(ref_grad, param.grad.full_tensor())

            # Check that at least one gradient has norm greater than the max
            # norm before clipping to ensure the clipping is not vacuous
            self.assertTrue(any(vector_norm_fn(g).item() > max_norm for g in ref_grads))
            self.assertTrue(
                any(vector_norm_fn(g).item() > max_norm for g in local_grads)
            )

            # Check gradient norm clipping via total norm and individual
            # gradient norms post-clipping
            ref_total_norm = torch.nn.utils.clip_grad_norm_(
                ref_model.parameters(), max_norm=max_norm, norm_type=norm_type
            )
            comm_mode = CommDebugMode()
            with comm_mode:
                # foreach is default to turn on so we don't need to specify it.
                total_norm = clip_grad_norm_(
                    model.parameters(),
                    max_norm=max_norm,
                    norm_type=norm_type,
                )
            self.assertEqual(ref_total_norm, total_norm.full_tensor())
            # Expect one all-reduce per mesh dim for partial -> replicate
            # (ported: the count, and the op counted, are the implementation's; see the header)
            expected_all_reduces = self.impl.all_reduces(total_norm)
            self.assertEqual(
                comm_mode.get_comm_counts()[self.impl.all_reduce_op],
                expected_all_reduces,
            )
            # For zero gradients, clipping has no effect
            for param, grad in zip(ref_model.parameters(), ref_grads):
                self.assertTrue(vector_norm_fn(param.grad).item() <= max_norm)
                if torch.count_nonzero(grad):
                    self.assertFalse(torch.equal(param.grad, grad))
            for param, grad in zip(model.parameters(), local_grads):
                self.assertTrue(
                    vector_norm_fn(param.grad.to_local()).item() <= max_norm
                )
                if torch.count_nonzero(grad):
                    self.assertFalse(torch.equal(param.grad.to_local(), grad))

    def test_clip_grad_norm_1d(self):
        for norm_type in (2, 1, float("inf")):
            torch.manual_seed(42)
            model_args = ModelArgs(dropout_p=0.0)
            model = Transformer(model_args)
            ref_model = DistributedDataParallel(copy.deepcopy(model).to(device_type))
            ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
            for module in model.modules():
                if isinstance(module, TransformerBlock):
                    fully_shard(module)
            fully_shard(model)
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            inp = torch.randint(
                0, model.model_args.vocab_size, (3, 16), device=device_type
            )
            self._test_clip_grad_norm(
                1, norm_type, ref_model, ref_optim, model, optim, inp
            )

    def test_clip_grad_norm_2d(self):
        for norm_type in (2, 1, 3, float("inf")):
            dp_size = 2
            global_mesh = init_device_mesh(
                device_type.type,
                (dp_size, self.world_size // dp_size),
                mesh_dim_names=("dp", "tp"),
            )
            dp_mesh, tp_mesh = global_mesh["dp"], global_mesh["tp"]
            torch.manual_seed(42)
            # Test using an MLP stack, not a transformer, since the transformer
            # has some more significant numeric differences from the TP
            model = MLPStack(16, with_seq_parallel=True).to(torch.float64)  # ported: float64 (see the header)
            ref_model = DistributedDataParallel(
                copy.deepcopy(model).to(device_type), process_group=dp_mesh.get_group()
            )
            ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
            model.parallelize(
                tp_mesh,
                dp_mesh,
                use_activation_checkpointing=False,
                reshard_after_forward=True,
            )
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            inp = torch.randn(2, 16, device=device_type).to(torch.float64)
            self._test_clip_grad_norm(
                0.5, norm_type, ref_model, ref_optim, model, optim, inp, dp_mesh
            )


def _fsdp_case(impl_name: str, test_name: str) -> None:
    impl = make_impl(impl_name, plans=nd.NormPlans() if impl_name == "ndclip" else None)
    getattr(_TestClipGradNormBase(impl, dist.get_world_size()), test_name)()


@pytest.mark.parametrize("impl_name", IMPLS)
def test_clip_grad_norm_1d(impl_name):
    run_on_ranks(2, _fsdp_case, impl_name, "test_clip_grad_norm_1d")


@pytest.mark.parametrize("impl_name", IMPLS)
def test_clip_grad_norm_2d(impl_name):
    run_on_ranks(4, _fsdp_case, impl_name, "test_clip_grad_norm_2d")


# --- exactness of the norm types torch has and the DTensor path lacked: p <= 0 -----------------

_P_VALUES = (-2.0, -math.inf, 0.0, 0.5)


def _close(got: float, expected: float, rtol: float = 1e-10) -> bool:
    return got == expected or abs(got - expected) <= rtol * abs(expected)


def _exactness_case(layout: str, sparse: bool) -> dict:
    """The float64 gradients of one ``MLPStack`` under FSDP2 (``"fsdp"``: a 1-D mesh) or FSDP2 x TP
    (``"fsdp_tp"``: dp 2 x tp 2), and of the plain model on this process: our total, per-tensor
    norms and clip against torch's functions on the plain gradients. Biases fix which ReLUs fire:
    ``sparse=False``, all (no zero element, so that ``p < 0`` is not trivially 0); ``sparse=True``, none in
    the middle MLP (the first MLP's gradients and the middle one's ``in_proj`` and ``out_proj.weight``
    are 0) and only units 0-7 of the last (its ``in_proj`` gradients are 0 on the shards of rows 8-47)."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = MLPStack(16, with_seq_parallel=True).to(torch.float64)
    with torch.no_grad():
        model[3].weight.uniform_(0.5, 1.5)  # with weight 1, sum(LayerNorm(x)) = 0 for every x: no gradient flows
        for mlp in list(model)[:3]:  # positive weights, biases and input: every ReLU fires
            for linear in (mlp.in_proj, mlp.out_proj):
                linear.weight.abs_()
                linear.bias.fill_(1.0)
        if sparse:
            model[1].in_proj.bias.fill_(-1e3)
            model[2].in_proj.bias[8:] = -1e3
    ref = copy.deepcopy(model)
    inp = torch.randn(2, 16, dtype=torch.float64).abs()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for mlp in list(model)[:3]:
            fully_shard(mlp, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        model.parallelize(mesh["tp"], mesh["dp"], use_activation_checkpointing=False)
    ref(inp).sum().backward()
    model(inp).sum().backward()
    ref_grads = [p.grad for p in ref.parameters()]
    grads = [p.grad for p in model.parameters()]
    with torch.no_grad():  # the plain gradients, laid out as the sharded ones (these differ in the last bits
        # from tensor-parallel sums, which for p = -2 the smallest elements magnify to ~1e-9)
        for g, r in zip(grads, ref_grads):
            replica = DTensor.from_local(r, g.device_mesh, [Replicate()] * g.device_mesh.ndim, run_check=False)
            g.to_local().copy_(replica.redistribute(g.device_mesh, g.placements).to_local())
            assert torch.equal(g.full_tensor(), r)
    saved_ref = [g.clone() for g in ref_grads]
    saved_local = [g.to_local().clone() for g in grads]
    out: dict = {}
    for p in _P_VALUES:
        expected = float(torch.nn.utils.get_total_norm(ref_grads, p))
        total = nd.get_total_norm(grads, p)
        assert isinstance(total, DTensor) and all(pl.is_replicate() for pl in total.placements)
        assert total.device_mesh.ndim == mesh.ndim
        got = float(total.full_tensor())
        assert float(total.to_local()) == total.item() == got
        per_tensor = nd.grad_norms(model, p).per_tensor
        assert per_tensor is not None
        expected_per = [float(torch.linalg.vector_norm(g, p)) for g in ref_grads]
        per_ok = all(_close(float(a), b) for a, b in zip(per_tensor, expected_per))
        # naive: every rank's local result, summed (p = 0) or p-summed (p = 0.5), as if no element had a copy
        local_count = torch.nn.utils.get_total_norm([g.to_local() for g in grads], 0.0).to(torch.float64)
        dist.all_reduce(local_count)
        local_power = sum(g.to_local().abs().sqrt().sum() for g in grads)
        dist.all_reduce(local_power)
        try:
            on_dtensors = float(torch.nn.utils.get_total_norm(grads, p).full_tensor())
        except Exception as e:  # noqa: BLE001 - recording what torch does on the DTensors
            on_dtensors = type(e).__name__
        # clip, from the same gradients: ours on the shards against torch's on the plain model
        for g, s in zip(ref_grads, saved_ref):
            g.copy_(s)
        for g, s in zip(grads, saved_local):
            g.to_local().copy_(s)
        max_norm = expected / 3
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, p)
        clipped = nd.clip_grad_norm_(model.parameters(), max_norm, p)
        clip_ok = _close(float(clipped), expected) and all(
            torch.allclose(g.full_tensor(), r, rtol=1e-10, atol=0) for g, r in zip(grads, ref_grads)
        )
        for g, s in zip(ref_grads, saved_ref):
            g.copy_(s)
        for g, s in zip(grads, saved_local):
            g.to_local().copy_(s)
        out[p] = {
            "expected": expected, "got": got, "per_tensor_ok": per_ok, "clip_ok": clip_ok,
            "naive_count": float(local_count), "naive_p0.5": float(local_power) ** 2, "torch_on_dtensors": on_dtensors,
        }
    return out


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("layout,world", [("fsdp", 2), ("fsdp_tp", 4)])
def test_nonpositive_norm_types_are_exact_on_any_mesh(layout, world, sparse):
    results = run_on_ranks(world, _exactness_case, layout, sparse)
    assert all(r == results[0] for r in results), "every rank returns the same"
    r = results[0]
    for p in _P_VALUES:
        got, expected = r[p]["got"], r[p]["expected"]
        assert _close(got, expected), f"p={p}: {got!r} != torch's {expected!r} on the plain model"
        assert r[p]["per_tensor_ok"] and r[p]["clip_ok"], (p, r[p])
    # p = 0 counts the logical tensors with a nonzero gradient: 13 parameters, 7 all-zero when sparse
    assert r[0.0]["expected"] == (6.0 if sparse else 13.0)
    assert not _close(r[0.0]["naive_count"], r[0.0]["expected"]), "summing each rank's count over-counts"
    if not sparse:  # no zero element: p < 0 is not trivially 0
        assert r[-2.0]["expected"] > 0 and r[-math.inf]["expected"] > 0
    if layout == "fsdp_tp":  # tensor-parallel replicas (LayerNorm, row-parallel biases) counted twice
        assert not _close(r[0.0]["naive_p0.5"], r[0.5]["expected"], rtol=1e-3)



# --- the rest of the drop-in contract: warnings, result types, totals passed between the two ----


def _empty():
    yield from ()


def test_the_empty_generator_warning_comes_where_torchs_does(impl: Impl):
    """Only ``clip_grad_norm_`` warns, only for an empty generator (torch's own behaviour is the oracle)."""
    clip_grad_norm_, get_total_norm, clip_grads_with_norm_ = impl.functions
    calls = {
        "clip_grad_norm_(generator)": lambda: clip_grad_norm_(_empty(), 1.0),
        "clip_grad_norm_([])": lambda: clip_grad_norm_([], 1.0),
        "get_total_norm(generator)": lambda: get_total_norm(_empty()),
        "clip_grads_with_norm_(generator)": lambda: clip_grads_with_norm_(_empty(), 1.0, torch.tensor(0.0)),
    }
    counts = {}
    for name, call in calls.items():
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            call()
        counts[name] = len(w)
    assert counts == {name: int(name == "clip_grad_norm_(generator)") for name in calls}


@pytest.mark.parametrize("norm_type", [0.0, -2.0, -math.inf])
def test_new_norm_types_read_nothing_on_the_host(norm_type):
    """As ``test_no_sync.py`` for the other norm types: on ``meta`` tensors any host read raises."""
    params = [nn.Parameter(torch.empty(s, device="meta")) for s in [(5, 3), (7,), (2, 2, 2)]]
    for p in params:
        p.grad = torch.empty_like(p)
    total = nd.clip_grad_norm_(params, 1.0, norm_type)
    assert total.device.type == "meta" and total.shape == ()
    nd.clip_grads_with_norm_(params, 1.0, nd.get_total_norm([p.grad for p in params], norm_type))
    norms = nd.grad_norms([(f"p{i}", p) for i, p in enumerate(params)], norm_type)
    assert norms.per_tensor is not None and norms.per_tensor.device.type == "meta"


def _totals_case() -> dict:
    """FSDP2 on 2 ranks: either implementation's total clips through the other's ``clip_grads_with_norm_``
    alike; and on two meshes, where torch raises, ours is a replica on the first DTensor's mesh."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = MLPStack(8)
    for mlp in model:
        fully_shard(mlp, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(4, 8)).sum().backward()
    params = list(model.parameters())
    saved = [p.grad.to_local().clone() for p in params]
    ours = nd.get_total_norm([p.grad for p in params])
    theirs = torch.nn.utils.get_total_norm([p.grad for p in params])
    out: dict = {
        "ours": (type(ours).__name__, [str(pl) for pl in ours.placements], ours.item()),
        "theirs": float(theirs.full_tensor()),
    }
    clipped = []
    for clip, total in product((nd.clip_grads_with_norm_, torch.nn.utils.clip_grads_with_norm_), (ours, theirs)):
        for p, s in zip(params, saved):
            p.grad.to_local().copy_(s)
        clip(params, 0.1 * ours.item(), total)
        clipped.append([p.grad.to_local().clone() for p in params])
    out["clips_agree"] = all(
        torch.allclose(a, b, rtol=1e-6, atol=0) for other in clipped[1:] for a, b in zip(clipped[0], other)
    )
    # two meshes over the same ranks: torch refuses, ours answers on the first DTensor's mesh
    other = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("other",))
    full = [torch.arange(6.0, dtype=torch.float64).reshape(3, 2), torch.full((4,), -2.0, dtype=torch.float64)]
    grads = [distribute_tensor(full[0], mesh, [Shard(0)]), distribute_tensor(full[1], other, [Replicate()])]
    total = nd.get_total_norm(grads)
    expected = float(torch.linalg.vector_norm(torch.cat([f.flatten() for f in full])))
    out["two_meshes"] = (total.device_mesh.mesh_dim_names, total.item(), expected)
    try:
        torch.nn.utils.get_total_norm(grads)
        out["torch_two_meshes"] = "ok"
    except Exception as e:  # noqa: BLE001 - recording what torch does
        out["torch_two_meshes"] = type(e).__name__
    return out


def test_totals_are_dtensors_that_either_implementation_clips_with():
    for r in run_on_ranks(2, _totals_case):
        kind, placements, value = r["ours"]
        assert kind == "DTensor" and placements == ["R"] and math.isclose(value, r["theirs"], rel_tol=1e-6)
        assert r["clips_agree"]
        names, got, expected = r["two_meshes"]
        assert names == ("dp",) and math.isclose(got, expected, rel_tol=1e-12)
        assert r["torch_two_meshes"] != "ok"


def _empty_shards_case() -> tuple[dict, list[int]]:
    """Rows over 4 ranks that leave ranks with empty shards (where torch's ``p < 0`` and ``-inf``
    norms raise): they contribute nothing, for every norm type."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=g, dtype=torch.float64) for s in [(1, 3), (3,), (2, 2)]]
    grads = [distribute_tensor(f, mesh, [Shard(0)]) for f in full]
    totals = {p: (nd.get_total_norm(grads, p).item(), float(torch.nn.utils.get_total_norm(full, p))) for p in _P_VALUES}
    return totals, [g.to_local().numel() for g in grads]


def test_empty_shards_contribute_nothing_for_the_new_norm_types():
    results = run_on_ranks(4, _empty_shards_case)
    assert any(0 in sizes for _, sizes in results), "some rank should hold an empty shard"
    for totals, _ in results:
        for p, (got, expected) in totals.items():
            assert _close(got, expected), (p, got, expected)
