"""The Lightning layer where transformers is not installed: no model of it means nothing of it is looked for.

A new user's first command (``pip install -e ".[examples]" && python examples/train_gpt.py``) installs no
transformers; every rank raised in ``setup`` because the random-stream setup looked for transformers models by
importing the library. Here transformers is made absent inside the workers (``helpers.not_installed``; CI also runs
the README's first command in a venv without it): the package's own models train on pp (dp_shard x tp, cp and ep: the
examples' runs in test_examples.py, each without the libraries its extras do not bring),
and only what needs transformers (``tp_plan="auto"`` on a module holding no model of any installed library) raises,
on every rank, naming the extra to install.
"""

from __future__ import annotations

import importlib.util

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import not_installed, use_existing_process_group
from test_examples import _main_on_rank, _summary
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ndclip import NDParallelStrategy, ParallelPlan


def _example_without_transformers(script: str, argv: list[str]) -> tuple[str, str]:
    with not_installed("transformers"):
        assert importlib.util.find_spec("lightning_ndclip") is not None
        with pytest.raises(ModuleNotFoundError):
            import transformers  # noqa: F401
        return _main_on_rank(script, argv)


def test_the_packages_own_pipeline_trains_without_transformers(tmp_path):
    """pp=2 x dp_shard=2 (the examples' own runs in test_examples.py cover dp_shard x tp, dp_shard x cp and ep with
    transformers absent: each example runs without the libraries its extras do not bring)."""
    argv = ["--max-steps", "2", "--rows", "64", "--layers", "2", "--accumulate", "1", "--tp", "1", "--pp", "2",
            "--dp-shard", "2", "--logdir", str(tmp_path)]  # fmt: skip
    out, _ = run_on_ranks(4, _example_without_transformers, "train_gpt.py", argv, timeout=240)[0]
    assert 0 < _summary(out, steps=2)["loss"] < 10


class _Plain(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.ones(8, 4)), batch_size=2)


def _auto_plan_without_transformers() -> tuple[str, str]:
    use_existing_process_group()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=NDParallelStrategy(tp=2, plan=ParallelPlan(tp_plan="auto")),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with not_installed("transformers"):
        try:
            trainer.fit(_Plain())
        except Exception as error:  # noqa: BLE001 - what each rank gets is the observation
            return type(error).__name__, str(error)
    return "no error", ""


def test_auto_plan_without_transformers_names_the_extra_on_every_rank():
    for kind, message in run_on_ranks(2, _auto_plan_without_transformers):
        assert kind == "ImportError", message
        assert "tp_plan='auto'" in message and "pip install 'lightning_ndclip[hf]'" in message
