"""Context parallelism over every model class with a context-parallel plan (``_cp_plan``) in the installed
``diffusers``: each, built tiny and random in float64, is cut on 2 and on 4 ranks where its plan says (the integration's
``context_parallelize``, tried whether or not the strategy accepts the class yet), and its output and the gradients of
``(output * fixed random weights).sum()`` (counted once per cp rank: each rank holds the whole gathered output, so
each rank's loss is divided by cp, and the gradients are summed over the ranks) are compared with the same model on
one process on the same input. Each class ends

* EXACT: the worst error relative to the largest entry is below 1e-10, or 1e-5 where the one-device model itself
  computes parts in float32 (Wan's norms); and the same cut with each rank attending over its own tokens only (no
  ring) is off by more, so the test sees the ring at work;
* REFUSED: ``context_parallelize`` or the forward raises lightning_ndclip's ValueError, naming the cause;
* WRONG or CRASH: a wrong number without a refusal, or an unnamed error: a failure;
* NOT BUILT: no tiny configuration here (listed; the strategy refuses such a class under cp).

A WRONG or CRASH class outside :data:`KNOWN` fails the test.

The strategy accepts exactly the classes this sweep finds EXACT (``context.VERIFIED``): the test says so, both
ways. ``pytest -s`` prints the table."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from helpers import Float32Ops, refused_by_us
from torch.distributed.device_mesh import init_device_mesh

diffusers = pytest.importorskip("diffusers")

from lightning_ndclip import _compat  # noqa: E402
from lightning_ndclip.integrations.diffusers import context  # noqa: E402

BATCH, TEXT = 2, 4


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _wan(g: torch.Generator, name: str = "WanTransformer3DModel") -> tuple[dict, dict]:
    config = dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16,
        freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
    )  # fmt: skip
    inputs = {"hidden_states": _randn(g, BATCH, 4, 2, 4, 4), "timestep": torch.rand(BATCH, generator=g) * 1000,
              "encoder_hidden_states": _randn(g, BATCH, 5, 16)}  # fmt: skip
    return config, inputs


def _flux(g: torch.Generator) -> tuple[dict, dict]:
    config = dict(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    grid = torch.meshgrid(torch.zeros(1), torch.arange(2.0), torch.arange(4.0), indexing="ij")
    inputs = {
        "hidden_states": _randn(g, BATCH, 8, 4), "encoder_hidden_states": _randn(g, BATCH, TEXT, 16),
        "pooled_projections": _randn(g, BATCH, 8), "timestep": torch.rand(BATCH, generator=g, dtype=torch.float64),
        "img_ids": torch.stack(grid, -1).reshape(-1, 3).double(), "txt_ids": torch.zeros(TEXT, 3, dtype=torch.float64),
    }  # fmt: skip
    return config, inputs


def _flux2(g: torch.Generator) -> tuple[dict, dict]:
    config = dict(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, timestep_guidance_channels=16, axes_dims_rope=(2, 2, 2, 2),
    )  # fmt: skip
    image = torch.cartesian_prod(torch.arange(1), torch.arange(2), torch.arange(4), torch.arange(1))
    text = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(TEXT))
    inputs = {
        "hidden_states": _randn(g, BATCH, 8, 4), "encoder_hidden_states": _randn(g, BATCH, TEXT, 16),
        "img_ids": image.expand(BATCH, -1, -1), "txt_ids": text.expand(BATCH, -1, -1),
        "timestep": torch.rand(BATCH, generator=g, dtype=torch.float64), "guidance": torch.ones(BATCH, dtype=torch.float64),
    }  # fmt: skip
    return config, inputs


def _qwen_image(g: torch.Generator) -> tuple[dict, dict]:
    config = dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
    )  # fmt: skip
    mask = torch.ones(BATCH, TEXT, dtype=torch.long)
    mask[1, 3:] = 0  # a shorter prompt
    inputs = {
        "hidden_states": _randn(g, BATCH, 8, 16), "encoder_hidden_states": _randn(g, BATCH, TEXT, 16),
        "encoder_hidden_states_mask": mask, "timestep": torch.rand(BATCH, generator=g, dtype=torch.float64),
        "img_shapes": [(1, 2, 4)] * BATCH,
    }  # fmt: skip
    return config, inputs


def _ltx(g: torch.Generator) -> tuple[dict, dict]:
    config = dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16, num_layers=1,
        caption_channels=16,
    )  # fmt: skip
    mask = torch.ones(BATCH, TEXT, dtype=torch.bool)
    mask[0, 3:] = False  # a shorter prompt: its last text token masked in the cross-attention
    mask[1] = False  # none left: LTX's -10000 bias on every key cancels, and the clip attends to all of them
    inputs = {
        "hidden_states": _randn(g, BATCH, 2 * 2 * 4, 4), "encoder_hidden_states": _randn(g, BATCH, TEXT, 16),
        "timestep": torch.randint(0, 1000, (BATCH,), generator=g), "encoder_attention_mask": mask,
        "num_frames": 2, "height": 2, "width": 4,
    }  # fmt: skip
    return config, inputs


def _ltx2(g: torch.Generator) -> tuple[dict, dict]:
    config = dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=1, caption_channels=16, rope_double_precision=True,
    )  # fmt: skip
    mask = torch.ones(BATCH, TEXT, dtype=torch.bool)
    mask[1, 3:] = False
    inputs = {
        "hidden_states": _randn(g, BATCH, 2 * 2 * 4, 4), "audio_hidden_states": _randn(g, BATCH, 3, 4),
        "encoder_hidden_states": _randn(g, BATCH, TEXT, 16), "audio_encoder_hidden_states": _randn(g, BATCH, TEXT, 16),
        "timestep": torch.rand(BATCH, generator=g, dtype=torch.float64) * 1000, "encoder_attention_mask": mask,
        "num_frames": 2, "height": 2, "width": 4, "audio_num_frames": 3, "fps": 25.0,
    }  # fmt: skip
    return config, inputs


def _helios(g: torch.Generator) -> tuple[dict, dict]:
    config = dict(  # 40 blocks: its plan gathers after blocks.0 .. blocks.39's attention and feed-forward by name
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16,
        freq_dim=16, ffn_dim=32, num_layers=40, rope_dim=(4, 2, 2), has_multi_term_memory_patch=False,
    )  # fmt: skip
    inputs = {"hidden_states": _randn(g, BATCH, 4, 2, 4, 4), "timestep": torch.rand(BATCH, generator=g) * 1000,
              "encoder_hidden_states": _randn(g, BATCH, 5, 16)}  # fmt: skip
    return config, inputs


def _minimax_h3(g: torch.Generator) -> tuple[dict, dict]:
    config = dict(
        num_attention_heads=2, attention_head_dim=12, hidden_size=24, num_layers=2, num_refiner_layers=1, ffn_dim=32,
        in_channels=4, audio_in_channels=4, text_dim=16, freq_dim=16, time_embed_hidden_dim=16, time_embed_dim=16,
        rope_freq_dim=2,
    )  # fmt: skip
    # one packed sequence of 16 rows: 4 text, 8 video (2 frames of 2 x 2 patches), 4 audio; two noise levels
    grid = torch.stack(torch.meshgrid(*(torch.arange(2),) * 3, indexing="ij"), -1).reshape(-1, 3)
    inputs = {
        "hidden_states": _randn(g, BATCH, 8, 16), "audio_hidden_states": _randn(g, BATCH, 4, 4),
        "encoder_hidden_states": _randn(g, BATCH, TEXT, 16), "timestep": torch.tensor([0.0, 0.7], dtype=torch.float64),
        "timestep_indices": torch.tensor([0] * 4 + [1] * 12), "token_tags": torch.tensor([1] * 4 + [0] * 8 + [2] * 4),
        "position_ids": torch.cat([torch.zeros(4, 3, dtype=torch.long), grid, torch.arange(4)[:, None].expand(4, 3)]),
        "text_indices": torch.arange(0, 4), "video_indices": torch.arange(4, 12), "audio_indices": torch.arange(12, 16),
    }  # fmt: skip
    return config, inputs


BUILDERS: dict[str, Callable[[torch.Generator], tuple[dict, dict]]] = {
    "WanTransformer3DModel": _wan,
    "ChronoEditTransformer3DModel": lambda g: _wan(g, "ChronoEditTransformer3DModel"),
    "FluxTransformer2DModel": _flux,
    "Flux2Transformer2DModel": _flux2,
    "QwenImageTransformer2DModel": _qwen_image,
    "LTXVideoTransformer3DModel": _ltx,
    "LTX2VideoTransformer3DModel": _ltx2,
    "HeliosTransformer3DModel": _helios,
    "MiniMaxH3Transformer3DModel": _minimax_h3,
}
"""A tiny configuration and an input of 2 clips (8 latent tokens, 4 text tokens) per class."""

KNOWN: dict[str, tuple[str, str]] = {}
"""class -> (outcome, why): the classes whose plan is not exact as diffusers ships it; the strategy refuses them
(not in ``context.VERIFIED``)."""


def _classes() -> list[str]:
    """Every model class of the installed diffusers with a ``_cp_plan``."""
    found = []
    for name in dir(diffusers.models):
        try:
            value = getattr(diffusers.models, name)
        except Exception:  # an optional dependency diffusers lacks
            continue
        if inspect.isclass(value) and _compat.diffusers_cp_plan(value):
            found.append(name)
    return sorted(found)


def _run(name: str, cp: Any = None) -> tuple[torch.nn.Module, list[torch.Tensor], torch.Tensor, set[str]]:
    """The class built tiny (seeded alike on every rank), cut over ``cp`` if given, run on its input: the model, its
    outputs, the loss and the ops that computed in float32."""
    config, inputs = BUILDERS[name](torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = getattr(diffusers, name)(**config).double()
    if cp is not None:
        with mock.patch.object(context, "VERIFIED", (name,)):  # tried whether or not the strategy accepts it
            context.context_parallelize(model, cp)
    with Float32Ops() as float32_ops:
        outputs = [t for t in model(**inputs, return_dict=False) if isinstance(t, torch.Tensor)]
    g = torch.Generator().manual_seed(2)
    loss = sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum() for t in outputs)
    return model, outputs, loss, float32_ops.found


def _errors(name: str, cp: Any, expected: dict[str, torch.Tensor], outputs: list[torch.Tensor]) -> tuple[float, str]:
    """The worst relative error of the cut model's outputs and gradients (summed over the ranks), and where."""
    model, got, loss, _ = _run(name, cp)
    (loss / cp.size()).backward()
    errors = {f"output {i}": float((a - b).abs().max() / b.abs().max()) for i, (a, b) in enumerate(zip(got, outputs))}
    scale = max(g.abs().max() for g in expected.values())
    for param_name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad)
        reference = expected.get(param_name, torch.zeros_like(grad))
        errors[param_name] = float((grad - reference).abs().max() / torch.maximum(reference.abs().max(), 1e-3 * scale))
    worst = max(errors, key=errors.__getitem__)
    return errors[worst], worst


def _one(name: str, cp: Any) -> tuple[str, str, float, float]:
    if name not in BUILDERS:
        return "NOT BUILT", "no tiny configuration in this test", 0.0, 0.0
    model, outputs, loss, float32_ops = _run(name)
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    tolerance = 1e-5 if float32_ops else 1e-10
    try:
        error, worst = _errors(name, cp, expected, [o.detach() for o in outputs])
    except Exception as error:
        if refused_by_us(error):
            return "REFUSED", str(error), 0.0, tolerance
        return "CRASH", f"{type(error).__name__}: {str(error)[:200]}", 0.0, tolerance
    if error >= tolerance:
        return "WRONG", f"worst: {worst}", error, tolerance
    with mock.patch.object(context._CutSequence, "attend", _own_tokens_only):
        without_ring, _ = _errors(name, cp, expected, [o.detach() for o in outputs])
    if without_ring < 1e-3:
        return "WRONG", f"the cut without the ring is as close ({without_ring:.1e}): the test sees no ring", error, tolerance
    return "EXACT", f"without the ring: {without_ring:.1e}", error, tolerance


def _own_tokens_only(self, query, key, value, **kwargs):
    """The cut without the ring: each cp rank's queries attend over its own keys only (masks dropped)."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def _sweep(names: list[str]) -> dict[str, tuple[str, str, float, float]]:
    cp = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))["cp"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: _one(name, cp) for name in names}


@pytest.mark.parametrize("cp", [2, 4])
def test_every_diffusers_model_with_a_cp_plan_is_exact_or_refused_and_the_strategy_accepts_the_exact_ones(cp):
    names = _classes()
    assert {"WanTransformer3DModel", "FluxTransformer2DModel", "LTXVideoTransformer3DModel"} <= set(names)
    outcomes = run_on_ranks(cp, _sweep, names, timeout=300)[0]
    print()
    for name, (outcome, detail, error, tolerance) in sorted(outcomes.items(), key=lambda item: (item[1][0], item[0])):
        print(f"{outcome:9s} {name:32s} {error:9.2e} / {tolerance:.0e}  {detail[:160]}")
    print(f"diffusers {diffusers.__version__}")
    failures = {n: o for n, o in outcomes.items() if o[0] in ("WRONG", "CRASH") and KNOWN.get(n, ("",))[0] != o[0]}
    assert not failures
    exact = {n for n, o in outcomes.items() if o[0] == "EXACT"}
    assert exact == set(context.VERIFIED) & set(names), "context.VERIFIED must list exactly the classes exact here"


def _ltx2_as_diffusers_plans_it() -> tuple[str, str, float, float]:
    with mock.patch.object(context, "CUT_LIKE", {}):
        return _sweep(["LTX2VideoTransformer3DModel"])["LTX2VideoTransformer3DModel"]


def test_ltx2_needs_its_cross_attention_rotary_embedding_cut():
    """LTX-2 with its own plan alone (no ``CUT_LIKE``): the cut video queries of its audio-video cross-attention meet
    the rotary embedding of the whole video, an error the sweep above no longer sees."""
    outcome, detail, _, _ = run_on_ranks(2, _ltx2_as_diffusers_plans_it)[0]
    assert outcome == "CRASH" and "size" in detail, (outcome, detail)
