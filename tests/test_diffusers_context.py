"""diffusers models under context parallelism, cut where their own ``_cp_plan`` says
(``ParallelPlan(tp_plan="auto")``), against the plain model on one process in float64.

A video team's fine-tune as it is written for one device: a tiny ``WanTransformer3DModel`` (and ChronoEdit, built
of the same blocks) in a LightningModule, a flow-matching loss per latent element, clips of different masked
lengths, ``loss_normalization="sample_mean"`` (each clip's mean over its own elements, then the mean over the clips
of the global batch), accumulation, activation checkpointing and ``GlobalNormClip``. The cp ranks each run their
part of the latent tokens through the blocks (the first block is checked to see it), attend over the whole clip by
the ring, and gather the output the plan gathers. Flux's plan cuts its text tokens too (joint attention over both).
"""

from __future__ import annotations

from unittest import mock

import pytest

pytest.importorskip("diffusers")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from diffusers import ChronoEditTransformer3DModel, WanTransformer3DModel  # noqa: E402
from diffusers.models.transformers.transformer_wan import WanTransformerBlock  # noqa: E402
from harness import run_on_ranks  # noqa: E402
from helpers import use_existing_process_group  # noqa: E402
from test_diffusers_sweep import _own_tokens_only  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

import lightning_ndclip as nd  # noqa: E402
from lightning_ndclip.integrations.diffusers import context  # noqa: E402
from lightning_ndclip.integrations.diffusers.context import _CutSequence  # noqa: E402

_ATTEND = _CutSequence.attend

CLIPS, STEPS, LR, MAX_NORM = 4, 3, 0.5, 0.05
LATENT = (4, 2, 4, 4)  # channels, frames, height, width: 2 x 2 x 2 = 8 tokens of patch (1, 2, 2)


FAMILIES = {"Wan": WanTransformer3DModel, "ChronoEdit": ChronoEditTransformer3DModel}


def _wan(family: str = "Wan") -> torch.nn.Module:
    torch.manual_seed(0)
    model = FAMILIES[family](
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16,
        freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
    )  # fmt: skip
    return model.double()


def _clips() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(CLIPS, *LATENT, generator=g, dtype=torch.float64)
    noise = torch.randn(CLIPS, *LATENT, generator=g, dtype=torch.float64)
    level = torch.rand(CLIPS, generator=g, dtype=torch.float64)
    frames_kept = torch.tensor([2, 1, 2, 1])  # clips of different lengths: masked frames
    mask = torch.zeros(CLIPS, *LATENT, dtype=torch.bool)
    for i, kept in enumerate(frames_kept.tolist()):
        mask[i, :, :kept] = True
    text = torch.randn(CLIPS, 5, 16, generator=g, dtype=torch.float64)
    return {"latents": latents, "noise": noise, "level": level, "mask": mask, "text": text}


def _per_element_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Flow matching: the velocity from the clip to the noise, per latent element, ``[clips, elements]``."""
    s = batch["level"].view(-1, 1, 1, 1, 1)
    noisy = (1 - s) * batch["latents"] + s * batch["noise"]
    out = model(hidden_states=noisy, timestep=batch["level"] * 1000, encoder_hidden_states=batch["text"]).sample
    return ((out - (batch["noise"] - batch["latents"])) ** 2).flatten(1)


class LitWan(L.LightningModule):
    def __init__(self, draw_noise: bool = False, family: str = "Wan") -> None:
        super().__init__()
        self.model = _wan(family)
        self.draw_noise = draw_noise  # drawn in the step, as a training recipe does, instead of read from the data
        self.first_block_tokens: list[int] = []
        norm = self.model.blocks[0].norm1  # the first thing the first block does with its tokens
        norm.register_forward_pre_hook(lambda m, args: self.first_block_tokens.append(args[0].shape[1]))

    def sample_ids(self, batch):
        rows = torch.arange(batch["mask"].shape[0]).view(-1, 1).expand(-1, batch["mask"][0].numel())
        return torch.where(batch["mask"].flatten(1), rows, -1), batch["mask"].shape[0]

    def training_step(self, batch, batch_idx):
        if self.draw_noise:  # alike on the cp peers (one clip), apart on the data ranks: the strategy's streams
            batch = {**batch, "noise": torch.randn_like(batch["latents"]), "level": torch.rand_like(batch["level"])}
        return _per_element_losses(self.model, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        clips = _clips()
        rows = [{key: value[i] for key, value in clips.items()} for i in range(CLIPS)]
        return torch.utils.data.DataLoader(rows, batch_size=1)


def _reference(family: str = "Wan") -> dict[str, torch.Tensor]:
    """The plain model on one process: per window (every data rank's micro-batches: all 4 clips, in an order the
    sampler shuffles and the mean does not see), each clip's mean over its kept elements, the mean over the clips;
    the gradient clipped to MAX_NORM; SGD."""
    model = _wan(family)
    clips = _clips()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        batch = clips
        losses = _per_element_losses(model, batch)
        mask = batch["mask"].flatten(1)
        loss = ((losses * mask).sum(1) / mask.sum(1)).mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fit(layout: dict[str, int], without_ring: bool = False) -> dict:
    use_existing_process_group()
    if without_ring:
        from lightning_ndclip.integrations.diffusers import context

        context._CutSequence.attend = _own_tokens_only  # the workers are reused: put back below
    try:
        return _train(layout)
    finally:
        if without_ring:
            context._CutSequence.attend = _ATTEND


def _train(layout: dict[str, int]) -> dict:
    layout = dict(layout)
    module = LitWan(family=layout.pop("family", "Wan"))
    block = type(module.model.blocks[0])  # ChronoEdit's is a class of its own, of the same name
    checkpointed = [block] if layout.pop("checkpointing", False) else []
    plan = nd.ParallelPlan(tp_plan="auto", fsdp_units=[block], activation_checkpointing=checkpointed)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, max_steps=STEPS, accumulate_grad_batches=CLIPS // layout.get("dp_shard", 1),
        strategy=nd.NDParallelStrategy(**layout, plan=plan, loss_normalization="sample_mean", summary=False),
        callbacks=[nd.GlobalNormClip(MAX_NORM)], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    unwrapped = {n.replace("._checkpoint_wrapped_module", ""): p for n, p in module.model.named_parameters()}
    params = {n: p.full_tensor().detach().clone() for n, p in unwrapped.items()}
    return {"params": params, "first_block_tokens": module.first_block_tokens[0]}


def _worst(results: list[dict], expected: dict[str, torch.Tensor]) -> float:
    return max(float((v - expected[n]).norm() / expected[n].norm()) for r in results for n, v in r["params"].items())


@pytest.mark.parametrize(
    "layout",
    [
        {"dp_shard": 2, "cp": 2}, {"cp": 4}, {"dp_shard": 2, "cp": 2, "checkpointing": True},
        {"dp_shard": 2, "cp": 2, "family": "ChronoEdit"},
    ],  # fmt: skip
    ids=["Wan-dp_shard2xcp2", "Wan-cp4", "Wan-dp_shard2xcp2-checkpointed", "ChronoEdit-dp_shard2xcp2"],
)
def test_wan_under_cp_equals_one_device_and_each_cp_rank_runs_its_part_of_the_tokens(layout):
    # Wan computes its norms in float32 (hidden_states.float()): equal to one device to float32's rounding, where
    # the cut without the ring is off by far more
    expected = _reference(layout.get("family", "Wan"))
    results = run_on_ranks(4, _fit, layout)
    assert [r["first_block_tokens"] for r in results] == [8 // layout["cp"]] * 4  # 8 latent tokens, cut
    assert _worst(results, expected) < 1e-6
    assert _worst(run_on_ranks(4, _fit, layout, True), expected) > 1e-3


def _verified(layout: dict[str, int]) -> str | None:
    use_existing_process_group()
    verify = nd.VerifyOneDevice(on_mismatch="warn")
    plan = nd.ParallelPlan(tp_plan="auto", fsdp_units=[WanTransformerBlock])
    trainer = L.Trainer(
        accelerator="cpu", devices=4, max_steps=1, accumulate_grad_batches=CLIPS // layout.get("dp_shard", 1),
        strategy=nd.NDParallelStrategy(**layout, plan=plan, loss_normalization="sample_mean", summary=False),
        callbacks=[verify, nd.GlobalNormClip(MAX_NORM)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(LitWan(draw_noise=True))
    return verify.report


def test_verify_one_device_replays_the_cut_model_and_its_drawn_noise_on_one_process():
    report = run_on_ranks(4, _verified, {"dp_shard": 2, "cp": 2})[0]
    assert "verdict: exact" in report, report
    # Wan's norms compute in float32 in a float64 run: compared to float32's rounding, and the report says so
    assert "the model casts activations to float32" in report and "rtol 0.0001" in report, report


def _unverified_model_under_cp() -> str:
    """A model with a _cp_plan its test has not verified (every class of diffusers 0.42.1 is: Wan taken off the list)."""
    meshes = nd.ParallelDims(world_size=2, dp_shard=1, cp=2).build_mesh("cpu")
    with mock.patch.object(context, "VERIFIED", ("FluxTransformer2DModel",)), pytest.raises(ValueError) as error:
        nd.parallelize(_wan(), meshes, tp_plan="auto")
    return str(error.value)


def test_a_plan_not_yet_verified_is_refused_naming_the_model_on_every_rank():
    for message in run_on_ranks(2, _unverified_model_under_cp):
        assert "WanTransformer3DModel's context-parallel plan is not yet verified" in message
        assert "verified: FluxTransformer2DModel" in message


# --- Flux: image and text tokens cut alike, joint attention over both -------------------------------------------

FLUX_TOKENS, FLUX_TEXT = 8, 4


def _flux() -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(2, 2, 4),
    ).double()  # fmt: skip


def _flux_clips() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    shape = (CLIPS, FLUX_TOKENS, 4)
    mask = torch.ones(shape, dtype=torch.bool)
    mask[1, 6:] = mask[3, 4:] = False  # images of different sizes: padded tokens
    return {
        "latents": torch.randn(shape, generator=g, dtype=torch.float64),
        "noise": torch.randn(shape, generator=g, dtype=torch.float64),
        "level": torch.rand(CLIPS, generator=g, dtype=torch.float64),
        "mask": mask,
        "text": torch.randn(CLIPS, FLUX_TEXT, 16, generator=g, dtype=torch.float64),
        "pooled": torch.randn(CLIPS, 8, generator=g, dtype=torch.float64),
    }


def _flux_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    grid = torch.meshgrid(torch.zeros(1), torch.arange(2.0), torch.arange(FLUX_TOKENS / 2), indexing="ij")
    img_ids = torch.stack(grid, -1).reshape(-1, 3).double()
    s = batch["level"].view(-1, 1, 1)
    noisy = (1 - s) * batch["latents"] + s * batch["noise"]
    out = model(
        hidden_states=noisy, encoder_hidden_states=batch["text"], pooled_projections=batch["pooled"],
        timestep=batch["level"], img_ids=img_ids, txt_ids=torch.zeros(FLUX_TEXT, 3, dtype=torch.float64),
    ).sample  # fmt: skip
    return ((out - (batch["noise"] - batch["latents"])) ** 2).flatten(1)


class LitFlux(LitWan):
    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.model = _flux()
        self.first_block_tokens = []
        norm = self.model.transformer_blocks[0].norm1  # the first block's image tokens
        norm.register_forward_pre_hook(lambda m, args: self.first_block_tokens.append(args[0].shape[1]))

    def training_step(self, batch, batch_idx):
        return _flux_losses(self.model, batch)

    def train_dataloader(self):
        clips = _flux_clips()
        return torch.utils.data.DataLoader([{k: v[i] for k, v in clips.items()} for i in range(CLIPS)], batch_size=1)


def _flux_reference() -> dict[str, torch.Tensor]:
    model, clips = _flux(), _flux_clips()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        losses, mask = _flux_losses(model, clips), clips["mask"].flatten(1)
        optimizer.zero_grad()
        ((losses * mask).sum(1) / mask.sum(1)).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fit_flux(without_ring: bool = False) -> dict:
    use_existing_process_group()
    if without_ring:
        from lightning_ndclip.integrations.diffusers import context

        context._CutSequence.attend = _own_tokens_only  # the workers are reused: put back below
    try:
        return _train_flux()
    finally:
        if without_ring:
            context._CutSequence.attend = _ATTEND


def _train_flux() -> dict:
    module = LitFlux()
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock

    plan = nd.ParallelPlan(tp_plan="auto")  # FSDP2 units: the model's own blocks (its _repeated_blocks), both kinds
    trainer = L.Trainer(
        accelerator="cpu", devices=4, max_steps=STEPS, accumulate_grad_batches=2,
        strategy=nd.NDParallelStrategy(dp_shard=2, cp=2, plan=plan, loss_normalization="sample_mean", summary=False),
        callbacks=[nd.GlobalNormClip(MAX_NORM)], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    params = {n: p.full_tensor().detach().clone() for n, p in module.model.named_parameters()}
    units = [m for m in module.model.modules() if isinstance(m, FSDPModule)]
    blocks = {
        FluxTransformerBlock: len(module.model.transformer_blocks),
        FluxSingleTransformerBlock: len(module.model.single_transformer_blocks),
    }
    return {
        "params": params,
        "first_block_tokens": module.first_block_tokens[0],
        "blocks_sharded": blocks == {c: sum(isinstance(m, c) for m in units) for c in blocks},
        "context_note": [n for n in trainer.strategy.parallel_summary().notes if n.startswith("Context:")],
    }


def test_flux_under_cp_with_text_and_image_tokens_cut_equals_one_device():
    # the plan cuts the text tokens too: each cp rank's joint attention holds its part of both, the ring the rest
    expected = _flux_reference()
    results = run_on_ranks(4, _fit_flux)
    assert [r["first_block_tokens"] for r in results] == [FLUX_TOKENS // 2] * 4
    assert all(r["blocks_sharded"] for r in results)  # no fsdp_units given: each block of both kinds one unit
    assert results[0]["context_note"] == [
        "Context: each diffusers model's inputs cut where its _cp_plan says (1/2 of the tokens per rank, contiguous), its "
        "outputs gathered where it says; the attention over the cut sequence by ring attention"
    ]
    assert _worst(results, expected) < 1e-6
    assert _worst(run_on_ranks(4, _fit_flux, True), expected) > 1e-3
