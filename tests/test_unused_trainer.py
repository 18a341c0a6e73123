"""A vision-language LightningModule whose micro-batches mix image and text-only samples across ranks and windows
(images on rank 0 only in the first window, on rank 1 only in the second, none in the third),
trained with ``NDParallelStrategy(find_unused_parameters=True)``: every parameter after clipped AdamW steps equal to
the plain model on one process in float64, the vision tower untouched in a window without images (AdamW's weight
decay skips a parameter without gradient, as on one device); and the tower made an FSDP2 unit of its own, refused
on every rank naming it. Without the option (the default check): the same batches refused on every rank before
FSDP2's reduction, naming the tower, the ranks and the option; batches that reach the tower on every rank within each
window (each rank in another micro-batch) train exactly without it. The pure-PyTorch cases: test_unused.py."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from test_callbacks import Recorder
from torch import nn

import lightning_ndclip as nd

VOCAB, WIDTH, PATCH, TEXT, IMAGE_TOKENS = 16, 8, 6, 5, 3
LR, DECAY, MAX_NORM = 0.05, 0.1, 0.5
SAMPLES, STEPS = 12, 3
WITH_IMAGE = {0, 2, 5}  # windows of 4 samples (rank r: r, r + 2): images on rank 0 only, then rank 1 only, then none


class Vision(nn.Module):
    """A vision tower and its projector: image patches to token embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.tower, self.projector = nn.Linear(PATCH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.projector(torch.tanh(self.tower(patches)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.mix(h))


class TinyVLM(nn.Module):
    """Image tokens (when the sample has an image) before the text tokens, a causal-free stack of blocks, logits for
    the text positions."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vision = Vision()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.double()

    def forward(self, tokens: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(tokens)
        if image is not None:
            h = torch.cat([self.vision(image), h], dim=1)
        for block in self.blocks:
            h = block(h)
        return self.head(h[:, -tokens.shape[1] :])


EVERY_WINDOW = {0, 3, 4, 7, 8, 11}  # an image on each rank in every window, rank 0 in its first micro-batch, rank 1 its second


def _samples(with_image: set[int] = WITH_IMAGE) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    samples = []
    for i in range(SAMPLES):
        tokens, labels = (torch.randint(0, VOCAB, (TEXT,), generator=g) for _ in range(2))
        sample = {"tokens": tokens, "labels": labels}
        sample["labels"][torch.rand(TEXT, generator=g) < 0.3] = -100
        if i in with_image:
            sample["image"] = torch.randn(IMAGE_TOKENS, PATCH, generator=g, dtype=torch.float64)
        samples.append(sample)
    return samples


class VisionLanguageLM(L.LightningModule):
    """Written the usual way: the batch's image when it has one, per-token losses, the global token mean."""

    def __init__(self, with_image: set[int] = WITH_IMAGE) -> None:
        super().__init__()
        self.model, self.with_image = TinyVLM(), with_image

    def count_tokens(self, batch) -> torch.Tensor:
        return (batch["labels"] != -100).sum()

    def training_step(self, batch, batch_idx):
        logits = self.model(batch["tokens"], batch.get("image"))
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="none")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=DECAY)

    def train_dataloader(self):  # rank r: samples r, r + 2, ... in order (the windows of the reference)
        mine = torch.utils.data.Subset(_samples(self.with_image), range(self.global_rank, SAMPLES, 2))
        return torch.utils.data.DataLoader(mine, batch_size=1)


def _reference(with_image: set[int] = WITH_IMAGE) -> dict:
    """One process: each step the window's 4 samples, the token mean over them, clipped AdamW."""
    model = TinyVLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY)
    samples = _samples(with_image)
    norms = []
    for window in (samples[4 * k : 4 * k + 4] for k in range(STEPS)):
        optimizer.zero_grad()
        tokens = sum(int((s["labels"] != -100).sum()) for s in window)
        for s in window:
            logits = model(s["tokens"][None], s["image"][None] if "image" in s else None)
            loss = nn.functional.cross_entropy(logits[0], s["labels"], ignore_index=-100, reduction="sum")
            (loss / tokens).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], MAX_NORM)))
        optimizer.step()
    return {"norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _fit_case(units: list[type], find_unused: bool = True, with_image: set[int] = WITH_IMAGE) -> dict:
    use_existing_process_group()
    module = VisionLanguageLM(with_image)
    strategy = nd.NDParallelStrategy(
        dp_shard=2, plan=nd.ParallelPlan(fsdp_units=units), loss_normalization="token_mean",
        find_unused_parameters=find_unused, summary=False,
    )  # fmt: skip
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, accumulate_grad_batches=2, logger=recorder,
        log_every_n_steps=1, callbacks=[nd.GlobalNormClip(MAX_NORM)], use_distributed_sampler=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(module)
    except ValueError as error:
        return {"error": str(error)}
    norms = [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m]
    return {"norms": norms, "params": {n: p.detach().full_tensor() for n, p in module.model.named_parameters()}}


def test_a_vision_language_model_on_mixed_batches_trains_as_on_one_device():
    reference = _reference()
    assert min(reference["norms"]) > MAX_NORM, "clipping should be active at every step"
    result = run_on_ranks(2, _fit_case, [Block])[0]
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(reference["norms"]), rtol=1e-10, atol=0)
    assert result["params"].keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        torch.testing.assert_close(result["params"][name], value, rtol=1e-10, atol=1e-12, msg=name)


def test_the_vision_tower_as_an_fsdp2_unit_of_its_own_is_refused_naming_it():
    for result in run_on_ranks(2, _fit_case, [Block, Vision]):
        expected = "rank 0 was about to run the FSDP2 unit 'model.vision'; rank 1 was about to run the FSDP2 unit 'model.blocks.0'"  # noqa: E501
        assert expected in result["error"], result


def test_find_unused_parameters_with_a_pipeline_is_refused():
    with pytest.raises(ValueError, match="find_unused_parameters=True, pp > 1"):
        nd.NDParallelStrategy(pp=2, find_unused_parameters=True)


def test_without_the_option_the_mixed_batches_are_refused_before_fsdp2_reduces_naming_the_tower():
    """The first window reaches the tower on rank 0 only: without find_unused_parameters, FSDP2 would reduce
    gradients of different sizes (gloo: "Received data size doesn't match expected size"). Refused first, on every
    rank, naming the parameters, the ranks and the option."""
    for result in run_on_ranks(2, _fit_case, [Block], False):
        error = result["error"]
        assert "'model.vision.tower.weight'" in error and "on ranks [0] but not on ranks [1]" in error, error
        assert "find_unused_parameters=True" in error, error


def test_without_the_option_a_tower_every_rank_reaches_within_each_window_trains_exactly():
    """Rank 0 reaches the tower in its first micro-batch, rank 1 in its second: FSDP2 reduces the same gradients at
    the window's end, so the check must stay quiet, and the run equals one device."""
    reference = _reference(EVERY_WINDOW)
    result = run_on_ranks(2, _fit_case, [Block], False, EVERY_WINDOW)[0]
    assert "error" not in result, result["error"]
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(reference["norms"]), rtol=1e-10, atol=0)
    for name, value in reference["params"].items():
        torch.testing.assert_close(result["params"][name], value, rtol=1e-10, atol=1e-12, msg=name)
