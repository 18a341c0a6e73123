"""Pipelines in ``Trainer.fit``: ``NDParallelStrategy(pp=2, ...)`` with GlobalNormClip equals clipped
single-device training in float64 (schedules, pp x dp x tp, tied weights, the module's own hooks, resume,
validation, stages built in configure_model, sample_mean), and errors of a stage raise on every stage.
The model and the pure-PyTorch pipeline tests: test_pipeline.py."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from test_callbacks import Recorder
from test_pipeline import TinyLM, _batch, _reference
from torch import nn
from torch.distributed.tensor import DTensor

import lightning_ndclip as nd
from lightning_ndclip.core.pipeline import model_units, split_model

# --- in the Trainer: NDParallelStrategy(pp=2, ...) ---

PP_LR, PP_MAX_NORM = 0.5, 0.1


class _PipelinedLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM()

    def count_tokens(self, batch) -> torch.Tensor:
        return (batch[1] != -100).sum()

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # per-token losses
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="none")

    def training_step(self, batch, batch_idx):
        loss = self.trainer.strategy.run_pipeline(*batch)  # forward + backward of every micro-batch
        self.log("loss_share", loss, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=PP_LR)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_batch()), batch_size=8 // self.dp // 2)


def _reference_steps(steps: int, tied: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One device, clipped SGD on the whole batch per step (each Trainer step below covers every row:
    2 accumulated batches x dp ranks), so the data order inside a step does not matter."""
    model = TinyLM(tied=tied)
    tokens, labels = _batch()
    norms = []
    for _ in range(steps):
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), PP_MAX_NORM)))
        with torch.no_grad():
            for p in model.parameters():
                p -= PP_LR * p.grad
    return norms, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _fit_two_windows(module: L.LightningModule, strategy, devices: int, steps: int = 2) -> dict:
    """Fit with accumulation over 2 batches and GlobalNormClip; the final stage parameters (full
    tensors) and the logged pre-clip norms."""
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, accumulate_grad_batches=2,
        callbacks=[nd.GlobalNormClip(PP_MAX_NORM)], logger=recorder, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module)
    stages = module.model.values() if isinstance(module.model, nn.ModuleDict) else module.model
    params = {n: p.detach().full_tensor() for stage in stages for n, p in stage.named_parameters()}
    norms = [m["grad_norm/total"] for _, m in recorder.rows if "grad_norm/total" in m]
    return {"params": params, "norms": norms, "trainer": trainer}


def _trainer_pp_case(dp_shard: int, schedule: str, stages_per_rank: int) -> dict:
    use_existing_process_group()
    module = _PipelinedLM()
    module.dp = dp_shard
    splits = {1: ["layers.2"], 2: ["layers.1", "layers.2", "layers.3"]}[stages_per_rank]
    strategy = nd.NDParallelStrategy(
        pp=2, dp_shard=dp_shard, loss_normalization="token_mean",
        pipeline=nd.PipelineOptions(split_points=splits, schedule=schedule, stages_per_rank=stages_per_rank, microbatches=2),
        plan=nd.ParallelPlan(fsdp_units=(nn.Linear,) if dp_shard > 1 else ()),
    )
    r = _fit_two_windows(module, strategy, devices=2 * dp_shard)  # a step = 2 batches x dp = every row
    return {"params": r["params"], "norms": r["norms"], "loss": float(r["trainer"].callback_metrics["loss_share"])}


def _assert_norms_match(norms: list[float], ref_norms: list[float]) -> None:
    for ours, ref in zip(norms, ref_norms):
        assert abs(ours - ref) <= 1e-12 * ref


def _assert_params_match(params: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, value in params.items():
        assert float((value - expected[name]).norm() / expected[name].norm()) < 1e-12, name


@pytest.mark.parametrize(
    "dp_shard,schedule,stages_per_rank",
    [(1, "1f1b", 1), (1, "interleaved_1f1b", 2), (2, "gpipe", 1)],
    ids=["pp2-1f1b", "pp2-interleaved", "pp2xdp2-fsdp-gpipe"],
)
def test_trainer_with_pipeline_matches_single_device(dp_shard, schedule, stages_per_rank):
    ref_norms, expected = _reference_steps(2)
    assert min(ref_norms) > PP_MAX_NORM, "clipping should be active at every step"
    tokens, labels = _batch()
    one_step = _reference_steps(1)[1]
    with torch.no_grad():  # the loss of the last step, before its update
        model = TinyLM()
        for n, p in model.named_parameters():
            p.copy_(one_step[n])
        ref_loss = float(nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100))
    for r in run_on_ranks(2 * dp_shard, _trainer_pp_case, dp_shard, schedule, stages_per_rank):
        assert len(r["norms"]) == 2
        _assert_norms_match(r["norms"], ref_norms)
        assert abs(r["loss"] - ref_loss) <= 1e-12 * ref_loss  # every rank sees the last stage's loss
        _assert_params_match(r["params"], expected)


class _OwnZeroGradLM(_PipelinedLM):
    """``training_step(batch)`` without an index, and an ``optimizer_zero_grad`` of its own."""

    def training_step(self, batch):
        return self.trainer.strategy.run_pipeline(*batch)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self.zeroed_at.append((epoch, batch_idx))
        optimizer.zero_grad()


def _own_zero_grad_case() -> dict:
    use_existing_process_group()
    module = _OwnZeroGradLM()
    module.dp, module.zeroed_at = 1, []
    pipeline = nd.PipelineOptions(split_points=["layers.2"], microbatches=2)
    strategy = nd.NDParallelStrategy(pp=2, pipeline=pipeline, loss_normalization="token_mean")
    r = _fit_two_windows(module, strategy, devices=2)
    hooks = {"configure_model", "optimizer_zero_grad", "training_step", "backward"}
    return {"params": r["params"], "zeroed_at": module.zeroed_at, "patched": sorted(hooks & set(vars(module)))}


def test_a_pipelined_module_keeps_its_own_hooks_and_matches_single_device():
    _, expected = _reference_steps(2)
    for r in run_on_ranks(2, _own_zero_grad_case):
        # each window is an epoch's two batches: Lightning's hook, once per window, at its first batch
        assert r["zeroed_at"] == [(0, 0), (1, 0)]
        assert not r["patched"], f"the strategy set {r['patched']} on the LightningModule"
        _assert_params_match(r["params"], expected)


class _TiedPipelinedLM(_PipelinedLM):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLM(tied=True)


def _trainer_tied_case() -> dict:
    use_existing_process_group()
    module = _TiedPipelinedLM()
    module.dp = 1
    strategy = nd.NDParallelStrategy(
        pp=2, dp_shard=1, loss_normalization="token_mean",
        pipeline=nd.PipelineOptions(split_points=["layers.2"], microbatches=2, tied_parameters=[("embed.weight", "head.weight")]),
    )
    r = _fit_two_windows(module, strategy, devices=2, steps=1)
    return {"params": r["params"], "norm": r["norms"][0]}


def test_trainer_ties_embedding_and_head_across_stages():
    ref_grads, ref_norm = _reference(True)
    coef = min(1.0, PP_MAX_NORM / (float(ref_norm) + 1e-6))
    init = dict(TinyLM(tied=True).named_parameters(remove_duplicate=False))
    for r in run_on_ranks(2, _trainer_tied_case):
        assert abs(r["norm"] - float(ref_norm)) <= 1e-12 * float(ref_norm)
        for name, value in r["params"].items():
            expected = init[name].detach() - PP_LR * coef * ref_grads[name]
            assert float((value - expected).norm() / expected.norm()) < 1e-12, name
        assert {"embed.weight", "head.weight"} & set(r["params"])


def _tie_declaration_case(kind: str) -> str:
    use_existing_process_group()
    ties = {"misspelled": [("embed.weight", "head.wieght")], "undeclared": [], "untied": [("embed.weight", "head.weight")]}
    strategy = nd.NDParallelStrategy(
        pp=2, pipeline=nd.PipelineOptions(split_points=["layers.2"], microbatches=2, tied_parameters=ties[kind])
    )
    module = _PipelinedLM() if kind == "untied" else _TiedPipelinedLM()
    with pytest.raises(ValueError) as info:
        _fit_two_windows(module, strategy, devices=2, steps=1)
    return str(info.value)


@pytest.mark.faults
@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("misspelled", "['head.wieght'] is not a parameter name of model"),
        ("undeclared", "['embed.weight', 'head.weight'] are one tensor in model, and split_points ['layers.2'] put "
                       "them in stages [0, 1]: each stage would train its own copy"),
        ("untied", "entry ['embed.weight', 'head.weight']: these are different tensors in model"),
    ],
)  # fmt: skip
def test_a_tie_declaration_that_is_not_the_models_is_an_error_naming_it(kind, expected):
    """misspelled: 'head.wieght' lies in the unit 'head', so the stage check alone passed it: the last stage then
    had no copy to tie, and both ranks hung (seen: the harness's 120 s timeout). undeclared: each stage trained its
    own copy of the tied weight (norms 9.4625 against 9.4750 on one device). untied: the declaration copied the
    embedding over the head at setup, training another model (losses 15.6 against 2.9)."""
    for message in run_on_ranks(2, _tie_declaration_case, kind):
        assert expected in message, message


class _ThreeRowsPipelinedLM(_PipelinedLM):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_batch()), batch_size=3)


def _uneven_microbatches_case() -> str:
    use_existing_process_group()
    strategy = nd.NDParallelStrategy(pp=2, pipeline=nd.PipelineOptions(split_points=["layers.2"], microbatches=2))
    module = _ThreeRowsPipelinedLM()
    module.dp = 1
    with pytest.raises(ValueError) as info:
        _fit_two_windows(module, strategy, devices=2, steps=1)
    return str(info.value)


@pytest.mark.faults
def test_a_batch_the_microbatches_do_not_divide_is_an_error_on_every_rank():
    """3 rows in 2 micro-batches (or an epoch's short last batch): the first stage failed alone in autograd
    ('Mismatch in shape: grad_output[0] has a shape of torch.Size([2, 8, 16])'), the other lost its peer."""
    for message in run_on_ranks(2, _uneven_microbatches_case):
        assert "a batch of 3 rows does not split into PipelineOptions(microbatches=2)" in message, message


class _AdamPipelinedLM(_PipelinedLM):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def pipeline_loss(self, output, target):  # a micro-batch mean (no loss_normalization)
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=-100)


def _pp_resume_case(directory: str) -> dict:
    use_existing_process_group()

    def trainer(epochs: int) -> L.Trainer:
        strategy = nd.NDParallelStrategy(pp=2, dp_shard=1, pipeline=nd.PipelineOptions(split_points=["layers.2"], microbatches=2))
        return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
                         callbacks=[nd.GlobalNormClip(PP_MAX_NORM)], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)

    def module() -> _AdamPipelinedLM:
        m = _AdamPipelinedLM()
        m.dp = 1
        return m

    straight = module()
    trainer(3).fit(straight)
    first = trainer(1)
    first.fit(module())
    first.save_checkpoint(f"{directory}/pp.ckpt")
    resumed = module()
    with torch.no_grad():  # only a real restore (weights and Adam state) can undo this
        for p in resumed.parameters():
            p.add_(1.0)
    trainer(3).fit(resumed, ckpt_path=f"{directory}/pp.ckpt")
    params = lambda m: {n: p.detach().full_tensor() for s in m.model for n, p in s.named_parameters()}  # noqa: E731
    return {"straight": params(straight), "resumed": params(resumed)}


def test_pipelined_training_resumes_from_a_checkpoint_exactly(tmp_path):
    for r in run_on_ranks(2, _pp_resume_case, str(tmp_path)):
        assert r["straight"] and r["straight"].keys() == r["resumed"].keys()
        for name, value in r["straight"].items():
            assert torch.equal(value, r["resumed"][name]), name


class _AnyLayoutLM(_PipelinedLM):
    """Adam on the tied TinyLM with the global token mean: a pipeline on pp > 1, the model itself on pp = 1."""

    def __init__(self, dp: int) -> None:
        super().__init__()
        self.model, self.dp = TinyLM(tied=True), dp

    def training_step(self, batch, batch_idx):
        if self.trainer.strategy.pipeline_mesh is not None:
            return self.trainer.strategy.run_pipeline(*batch)
        return self.pipeline_loss(self.model(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _fit_on(layout: str | None, epochs: int, ckpt: str | None = None, save: str | None = None) -> dict:
    """Fit ``_AnyLayoutLM`` on 2 ranks: pp=2 cut at ``layout`` (dp 1), or pp=1 x dp_shard=2 (``None``); resume
    from ``ckpt`` (its weights first moved by +1, so only a real restore of weights and Adam state undoes it);
    save at the end to ``save``. This rank's parameters, whole, under the unsplit model's names."""
    if layout is None:
        plan = nd.ParallelPlan(fsdp_units=[TinyLM])  # one unit: the tie stays one parameter
        strategy = nd.NDParallelStrategy(dp_shard=2, plan=plan, loss_normalization="token_mean")
    else:
        tie = [("embed.weight", "head.weight")]
        pipeline = nd.PipelineOptions(split_points=[layout], microbatches=2, tied_parameters=tie)
        strategy = nd.NDParallelStrategy(pp=2, dp_shard=1, pipeline=pipeline, loss_normalization="token_mean")
    module = _AnyLayoutLM(dp=1 if layout else 2)
    if ckpt is not None:
        with torch.no_grad():
            for p in module.parameters():
                p.add_(1.0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
        callbacks=[nd.GlobalNormClip(PP_MAX_NORM)], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    stages = [module.model] if layout is None else list(module.model)
    return {n: p.detach().full_tensor() for s in stages for n, p in s.named_parameters(remove_duplicate=False)}


def _pp_any_layout_case(directory: str) -> dict:
    use_existing_process_group()
    straight = _fit_on("layers.2", 3)
    _fit_on("layers.2", 1, save=f"{directory}/pp2.ckpt")
    _fit_on(None, 1, save=f"{directory}/pp1.ckpt")
    return {
        "straight": straight,
        "pp2 -> other split": _fit_on("layers.1", 3, ckpt=f"{directory}/pp2.ckpt"),
        "pp2 -> pp1": _fit_on(None, 3, ckpt=f"{directory}/pp2.ckpt"),
        "pp1 -> pp2": _fit_on("layers.3", 3, ckpt=f"{directory}/pp1.ckpt"),
    }


def test_a_pipeline_checkpoint_resumes_on_another_pipeline_layout_exactly(tmp_path):
    """Saved on pp=2 cut at layers.2 after one epoch, resumed on another cut or on pp=1 (and from pp=1 on a pipeline):
    two more epochs of Adam equal three straight epochs, every parameter (the head tied to the embedding: one Adam
    state on pp=1, a copy on each end stage). It was refused ('saved with the pipeline layout ...')."""
    merged: dict[str, dict[str, torch.Tensor]] = {}
    for rank in run_on_ranks(2, _pp_any_layout_case, str(tmp_path)):
        for run, params in rank.items():
            merged.setdefault(run, {}).update(params)
    straight = merged.pop("straight")
    assert set(straight) == {"embed.weight", "head.weight", *(f"layers.{i}.{w}" for i in range(4) for w in ("weight", "bias"))}
    for run, params in merged.items():
        assert params.keys() == straight.keys(), run
        for name, value in straight.items():
            torch.testing.assert_close(params[name], value, rtol=1e-10, atol=1e-12, msg=f"{run}: {name}")


def _pp_user_stages_other_layout_case(directory: str) -> str:
    use_existing_process_group()
    module = _UserStagedLM()
    module.dp = 1
    pipeline = nd.PipelineOptions(microbatches=2)
    strategy = nd.NDParallelStrategy(pp=2, dp_shard=1, pipeline=pipeline, loss_normalization="token_mean")
    first = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    first.fit(module)
    first.save_checkpoint(f"{directory}/pp.ckpt")
    with pytest.raises(ValueError) as info:
        _fit_on("layers.2", 2, ckpt=f"{directory}/pp.ckpt")
    return str(info.value)


@pytest.mark.faults
def test_stages_built_in_configure_model_resume_on_their_own_layout_only(tmp_path):
    """Their tensors are named by their own stage keys, which another layout does not hold: refused naming both
    layouts, on every rank (it was dcp's missing-key error)."""
    for message in run_on_ranks(2, _pp_user_stages_other_layout_case, str(tmp_path)):
        assert "'split_points': [], 'names': 'stages'}" in message, message
        assert "this run has {'pp': 2, 'stages_per_rank': 1, 'split_points': ['layers.2'], 'names': 'unsplit'}" in message


class _ValidatedPipelinedLM(_PipelinedLM):
    def validation_step(self, batch, batch_idx):
        loss_sum = self.trainer.strategy.run_pipeline(*batch)  # forward only: Σ of micro-batch sums
        self.log("val_loss_sum", loss_sum, sync_dist=True, reduce_fx="sum")

    def val_dataloader(self):
        return self.train_dataloader()


def _validate_case() -> float:
    use_existing_process_group()
    module = _ValidatedPipelinedLM()
    module.dp = 1
    strategy = nd.NDParallelStrategy(pp=2, dp_shard=1, pipeline=nd.PipelineOptions(split_points=["layers.2"], microbatches=2))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    (result,) = trainer.validate(module)
    return result["val_loss_sum"]


def test_validation_runs_the_pipeline_forward_only():
    tokens, labels = _batch()
    with torch.no_grad():
        expected = float(nn.functional.cross_entropy(
            TinyLM()(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"))
    for value in run_on_ranks(2, _validate_case):
        assert abs(value - expected) <= 1e-12 * expected


class _TPPipelinedLM(_PipelinedLM):
    def parallelize_stage(self, stage: nn.Module) -> None:  # TP on this stage's pair, then FSDP2
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        meshes = self.trainer.strategy.meshes
        first = int(sorted(stage.layers)[0])
        parallelize_module(stage, meshes["tp"], {f"layers.{first}": ColwiseParallel(), f"layers.{first + 1}": RowwiseParallel()})
        for layer in stage.layers.values():
            fully_shard(layer, mesh=meshes["fsdp"])
        fully_shard(stage, mesh=meshes["fsdp"])


def _pp_dp_tp_trainer_case(schedule: str) -> dict:
    use_existing_process_group()
    module = _TPPipelinedLM()
    module.dp = 2
    strategy = nd.NDParallelStrategy(
        pp=2, dp_shard=2, tp=2, pipeline=nd.PipelineOptions(split_points=["layers.2"], schedule=schedule, microbatches=2),
        loss_normalization="token_mean",
    )
    r = _fit_two_windows(module, strategy, devices=8)
    return {"params": r["params"], "norms": r["norms"]}


def test_trainer_pp2_dp2_tp2_on_eight_ranks_matches_single_device():
    ref_norms, expected = _reference_steps(2)
    for r in run_on_ranks(8, _pp_dp_tp_trainer_case, "1f1b"):
        assert len(r["norms"]) == 2
        _assert_norms_match(r["norms"], ref_norms)
        _assert_params_match(r["params"], expected)


class _UserStagedLM(_PipelinedLM):
    def configure_model(self) -> None:  # the second way: build and parallelize this rank's stage
        from torch.distributed.fsdp import fully_shard

        from lightning_ndclip.core.pipeline import stage_units_of

        meshes = self.trainer.strategy.meshes
        index = meshes["pp"].get_local_rank()
        stage = split_model(TinyLM(), stage_units_of(model_units(TinyLM()), ["layers.2"], 2)[index])
        fully_shard(stage, mesh=meshes["fsdp"])
        self.model = nn.ModuleDict({str(index): stage})


def _user_stages_case() -> dict:
    use_existing_process_group()
    module = _UserStagedLM()
    module.dp = 1
    pipeline = nd.PipelineOptions(microbatches=2)
    strategy = nd.NDParallelStrategy(pp=2, dp_shard=1, pipeline=pipeline, loss_normalization="token_mean")
    r = _fit_two_windows(module, strategy, devices=2)
    return {"params": r["params"], "norms": r["norms"]}


def test_stages_built_in_configure_model_match_single_device():
    ref_norms, expected = _reference_steps(2)
    for r in run_on_ranks(2, _user_stages_case):
        assert len(r["norms"]) == 2 and r["params"]
        _assert_norms_match(r["norms"], ref_norms)
        _assert_params_match(r["params"], expected)


# --- sample_mean with pp > 1: the per-token weights travel with the schedule's row split ---


def _halves(labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Two packed samples per row (the first 3 tokens, the last 3), numbered over the batch."""
    rows, length = labels.shape
    ids = torch.arange(2 * rows).repeat_interleave(length // 2).reshape(rows, length)
    return ids, 2 * rows


class _SampleMeanPipelinedLM(_PipelinedLM):
    def sample_ids(self, batch):
        ids, samples = _halves(batch[1])
        return ids, samples, batch[1] != -100

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        per_token = nn.functional.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="none")
        return per_token.reshape(target.shape)


def _sample_mean_reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One device: the mean over samples with a valid token of each sample's mean token loss."""
    model = TinyLM()
    tokens, labels = _batch()
    ids, _ = _halves(labels)
    valid = labels != -100
    norms = []
    for _ in range(steps):
        model.zero_grad()
        per_token = nn.functional.cross_entropy(
            model(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none"
        ).reshape(labels.shape)
        means = [per_token[(ids == s) & valid].mean() for s in ids.unique() if ((ids == s) & valid).any()]
        torch.stack(means).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), PP_MAX_NORM)))
        with torch.no_grad():
            for p in model.parameters():
                p -= PP_LR * p.grad
    return norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _sample_mean_pp_case(dp_shard: int) -> dict:
    use_existing_process_group()
    module = _SampleMeanPipelinedLM()
    module.dp = dp_shard
    strategy = nd.NDParallelStrategy(
        pp=2, dp_shard=dp_shard, loss_normalization="sample_mean",
        pipeline=nd.PipelineOptions(split_points=["layers.2"], microbatches=2),
        plan=nd.ParallelPlan(fsdp_units=(nn.Linear,) if dp_shard > 1 else ()),
    )
    r = _fit_two_windows(module, strategy, devices=2 * dp_shard)  # a step = 2 batches x dp = every row
    return {"params": r["params"], "norms": r["norms"]}


@pytest.mark.parametrize("dp_shard", [1, 2], ids=["pp2", "pp2xdp2-fsdp"])
def test_sample_mean_with_a_pipeline_matches_single_device(dp_shard):
    ref_norms, expected = _sample_mean_reference(2)
    token_norms, _ = _reference_steps(2)
    assert abs(ref_norms[0] - token_norms[0]) > 1e-3 * token_norms[0], "the two means should differ here"
    for r in run_on_ranks(2 * dp_shard, _sample_mean_pp_case, dp_shard):
        assert len(r["norms"]) == 2
        _assert_norms_match(r["norms"], ref_norms)
        _assert_params_match(r["params"], expected)


class _ShortTargetLM(_SampleMeanPipelinedLM):
    def training_step(self, batch, batch_idx):
        return self.trainer.strategy.run_pipeline(batch[0], batch[1][:-1])  # one row short


def _short_target_case() -> str:
    use_existing_process_group()
    module = _ShortTargetLM()
    module.dp = 1
    strategy = nd.NDParallelStrategy(
        pp=2, dp_shard=1, pipeline=nd.PipelineOptions(split_points=["layers.2"], microbatches=2), loss_normalization="sample_mean"
    )
    with pytest.raises(ValueError) as info:
        _fit_two_windows(module, strategy, devices=2)
    return str(info.value)


@pytest.mark.faults
def test_a_sample_mean_target_of_the_wrong_size_raises_on_every_stage():
    for message in run_on_ranks(2, _short_target_case, timeout=60):  # a stage left waiting would time out
        assert "one row per row of sample ids (4)" in message


class _ScalarLossLM(_SampleMeanPipelinedLM):
    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return super().pipeline_loss(output, target).sum()  # not per-token: the strategy's check fails


class _FailingLossLM(_PipelinedLM):
    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        dp = self.trainer.strategy.meshes["dp"]
        if dp.get_local_rank() == dp.size() - 1:  # one pipeline (of the last data rank) only
            raise KeyError("logits")  # any error of the user's loss
        return super().pipeline_loss(output, target)


def _loss_error_case(normalization: str, dp_shard: int) -> tuple[str, str, str]:
    use_existing_process_group()
    module = _ScalarLossLM() if normalization == "sample_mean" else _FailingLossLM()
    module.dp = dp_shard
    strategy = nd.NDParallelStrategy(
        pp=2, dp_shard=dp_shard, pipeline=nd.PipelineOptions(split_points=["layers.2"], microbatches=2),
        loss_normalization=normalization,
    )  # fmt: skip
    with pytest.raises(Exception) as info:
        _fit_two_windows(module, strategy, devices=2 * dp_shard)
    cause = info.value.__cause__
    return type(info.value).__name__, str(info.value), type(cause).__name__ if cause is not None else ""


@pytest.mark.faults
@pytest.mark.parametrize(
    "normalization,error,text,dp_shard",
    [
        ("sample_mean", "ValueError", "pipeline_loss (pp > 1) must return per-token losses", 1),
        ("token_mean", "KeyError", "'logits'", 1),
        ("token_mean", "KeyError", "'logits'", 2),
    ],
    ids=["sample_mean", "token_mean", "token_mean-dp2"],
)
def test_an_error_in_pipeline_loss_raises_on_every_rank(normalization, error, text, dp_shard):
    """Once the schedule is through, every rank raises the same error, the failing last stages chained to their
    own; the old code timed out on the other stages, and with dp_shard=2 (the error shared over pp only) left
    the other pipeline's ranks waiting in the next collective."""
    results = run_on_ranks(2 * dp_shard, _loss_error_case, normalization, dp_shard, timeout=60)
    assert {(kind, message) for kind, message, _ in results} == {("AgreedError", results[0][1])}
    failing = 2 * dp_shard - 1  # the last stage (pp is the outermost mesh dim) of the last data rank's pipeline
    assert results[0][1].startswith(f"rank {failing}: pipeline_loss raised {error}: ") and text in results[0][1]
    assert [cause for _, _, cause in results] == [""] * failing + [error]


class _ManualTiedPipelinedLM(_TiedPipelinedLM):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def _refused_pp_case(what: str) -> str:
    use_existing_process_group()
    if what == "full_checkpoint":
        module = _PipelinedLM()
        options = nd.PipelineOptions(split_points=["layers.2"], microbatches=2)
        strategy = nd.NDParallelStrategy(pp=2, pipeline=options, save_distributed_checkpoint=False)
    else:
        module = _ManualTiedPipelinedLM()
        ties = [("embed.weight", "head.weight")]
        strategy = nd.NDParallelStrategy(
            pp=2, pipeline=nd.PipelineOptions(split_points=["layers.2"], microbatches=2, tied_parameters=ties)
        )
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError) as info:
        trainer.fit(module)
    return str(info.value)


@pytest.mark.parametrize("what", ["full_checkpoint", "manual_with_ties"])
def test_pipeline_setups_that_would_train_or_save_wrong_are_refused_on_every_rank(what):
    """A full checkpoint held only rank 0's stages; under manual optimization each tied copy stepped
    on its own stage's gradient (the copies are summed after training_step returns)."""
    expected = {"full_checkpoint": "save_distributed_checkpoint=True", "manual_with_ties": "automatic optimization"}
    for message in run_on_ranks(2, _refused_pp_case, what):
        assert expected[what] in message, message



class _OneStageFailsLM(_PipelinedLM):
    def parallelize_stage(self, stage: nn.Module) -> None:  # a user's hook that fails on the last stage only
        if stage.head is not None:
            raise RuntimeError("no plan for the head")


def _one_stage_fails_case() -> str:
    use_existing_process_group()
    module = _OneStageFailsLM()
    module.dp = 1
    strategy = nd.NDParallelStrategy(pp=2, pipeline=nd.PipelineOptions(split_points=["layers.2"], microbatches=2))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(Exception) as info:
        trainer.fit(module)
    return f"{type(info.value).__name__}: {info.value}"


def test_a_stage_that_fails_to_parallelize_raises_on_every_rank():
    """The first stage went on to the strategy's next collective and waited there for ever (a hang)."""
    first, last = run_on_ranks(2, _one_stage_fails_case)
    assert last == "RuntimeError: no plan for the head"
    assert first.startswith("AgreedError: rank 1: cutting and parallelizing pipeline stage 1 raised RuntimeError"), first


class _PlannedPipelinedLM(_PipelinedLM):
    """Pipelined by the strategy with a declarative loss-parallel tp plan written for the whole model (its entries name
    modules of both stages); its per-token losses from ``vocab_parallel_cross_entropy`` on the head's shards."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.model, self.dp, self.sharded = TinyLM(tied=tied), 1, set()

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if isinstance(output, DTensor):  # this rank's block of the vocabulary
            self.sharded.add(tuple(output.to_local().shape))
        return nd.vocab_parallel_cross_entropy(output, target)


def _planned_pp_case(tied: bool, embed: bool) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    use_existing_process_group()
    module = _PlannedPipelinedLM(tied)
    plan = {f"layers.{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(4)}
    plan["head"] = ColwiseParallel(output_layouts=Replicate())
    if embed:  # the vocabulary split of a tied embedding (as the head's)
        plan["embed"] = RowwiseParallel(input_layouts=Replicate())
    ties = [("embed.weight", "head.weight")] if tied else []
    strategy = nd.NDParallelStrategy(
        pp=2, tp=2, loss_normalization="token_mean", plan=nd.ParallelPlan(tp_plan=plan, loss_parallel=True),
        pipeline=nd.PipelineOptions(split_points=["layers.2"], microbatches=2, tied_parameters=ties),
    )  # fmt: skip
    try:
        r = _fit_two_windows(module, strategy, devices=4)
    except ValueError as error:
        return {"error": str(error)}
    return {"params": r["params"], "norms": r["norms"], "sharded": sorted(module.sharded)}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_declarative_loss_parallel_plan_for_the_whole_model_applies_to_each_stage(tied):
    """pp=2 x tp=2: each stage takes the plan's entries naming its modules (the layers' on both, the head's on the last,
    whose logits stay vocabulary-sharded, 6 + 5 of 11; a tied embedding's on the first); the clipped update equals one
    device's (float64). Before, the first stage refused the head's entry alone and the last one waited for it (a
    hang)."""
    ref_norms, expected = _reference_steps(2, tied=tied)
    for rank, r in enumerate(run_on_ranks(4, _planned_pp_case, tied, tied)):
        _assert_norms_match(r["norms"], ref_norms)
        _assert_params_match(r["params"], expected)
        last = rank >= 2  # pp rank 1: ranks 2 and 3, tp ranks 0 and 1
        assert r["sharded"] == ([(2, 6, 6 - rank % 2)] if last else []), r["sharded"]


def test_stages_sharding_a_tied_parameter_differently_are_refused_on_every_rank():
    """A vocabulary-sharded head tied to an embedding the plan leaves whole on the other stage: summing the copies'
    local gradients would add different slices (or fail inside gloo, their sizes differ)."""
    for r in run_on_ranks(4, _planned_pp_case, True, False):
        assert "['embed.weight', 'head.weight'] are one parameter" in r["error"], r
        assert "pp rank 0: ('whole',)" not in r["error"] and "pp rank 1: (" in r["error"], r["error"]
