"""The layouts Lightning users write, under a declarative plan: a LightningModule holding its blocks directly in an
``nn.ModuleList`` or ``nn.ModuleDict`` attribute (the nanoGPT habit) and its head as a plain ``nn.Linear``, trained on
dp_shard=2 x tp=2 with the exact token mean, equals the plain module trained on one process in float64; and FSDP2
warns of no view tensor from the units the strategy chooses."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from harness import run_on_ranks
from helpers import use_existing_process_group
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import lightning_ndclip as nd

VOCAB, WIDTH, LAYERS, STEPS, LR = 16, 8, 2, 2, 0.5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(h)))


class NanoLM(L.LightningModule):
    """Layers straight on the LightningModule: ``self.blocks`` an ``nn.ModuleList`` (or ``nn.ModuleDict``)."""

    def __init__(self, container: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        blocks = [Block() for _ in range(LAYERS)]
        listed = container.startswith("list")
        self.blocks = nn.ModuleList(blocks) if listed else nn.ModuleDict({f"b{i}": b for i, b in enumerate(blocks)})
        self.head = nn.Linear(WIDTH, VOCAB)
        if container.endswith("tied"):  # the nanoGPT habit: one weight for the embedding and the head
            self.head.weight = self.embed.weight
        self.double()

    def _blocks(self):
        return self.blocks if isinstance(self.blocks, nn.ModuleList) else self.blocks.values()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self._blocks():
            h = block(h)
        return self.head(h)

    def count_tokens(self, batch) -> torch.Tensor:
        return (batch[1] != -100).sum()

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        return nn.functional.cross_entropy(self(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data()), batch_size=2)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (4 * STEPS, 5), generator=g)
    labels = torch.randint(0, VOCAB, (4 * STEPS, 5), generator=g)
    labels[torch.rand(4 * STEPS, 5, generator=g) < 0.3] = -100
    return tokens, labels


def _reference(container: str) -> dict[str, torch.Tensor]:
    model = NanoLM(container)
    tokens, labels = _data()
    # Lightning's DistributedSampler shuffles the training rows (seed 0): data rank r reads order[r::2], 2 rows a
    # step, so step s covers order[4s : 4s + 4]
    order = torch.randperm(len(tokens), generator=torch.Generator().manual_seed(0)).tolist()
    for step in range(STEPS):
        rows = order[4 * step : 4 * step + 4]
        model.zero_grad()
        logits = model(tokens[rows])
        nn.functional.cross_entropy(logits.flatten(0, 1), labels[rows].flatten(), ignore_index=-100).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fit_case(container: str) -> dict:
    use_existing_process_group()
    module = NanoLM(container)
    names = [f"blocks.{i}" if container.startswith("list") else f"blocks.b{i}" for i in range(LAYERS)]
    tp_plan = {**{f"{n}.up": ColwiseParallel() for n in names}, **{f"{n}.down": RowwiseParallel() for n in names}}
    strategy = nd.NDParallelStrategy(dp_shard=2, tp=2, plan=nd.ParallelPlan(tp_plan=tp_plan, fsdp_units=[Block]),
                                     loss_normalization="token_mean", summary=False)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    return {
        "params": {n: p.detach().full_tensor() for n, p in module.named_parameters()},
        "view_warnings": [str(w.message)[:120] for w in caught if "returned a view tensor" in str(w.message)],
    }


@pytest.mark.parametrize("container", ["list", "dict", "list-tied"])
def test_blocks_in_a_module_container_train_exactly_under_a_declarative_plan(container):
    """fully_shard refused the container ('does not support containers that do not implement forward'); with a tied
    embedding and head, each child a root unit made the shared weight two parameters (refused by the tie check)."""
    reference = _reference(container)
    for result in run_on_ranks(4, _fit_case, container):
        assert result["view_warnings"] == []
        assert result["params"].keys() == reference.keys()
        for name, expected in reference.items():
            torch.testing.assert_close(result["params"][name], expected, rtol=1e-10, atol=1e-12, msg=name)


class NoForwardLM(NanoLM):
    """Tied, and training_step calls the children itself: no module forward to be the one FSDP2 root."""

    forward = L.LightningModule.forward

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        h = self.embed(tokens)
        for block in self._blocks():
            h = block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten(), ignore_index=-100)


def _refused_case(module: str) -> str:
    use_existing_process_group()
    strategy = nd.NDParallelStrategy(dp_shard=2, plan=nd.ParallelPlan(fsdp_units=[Block]), summary=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    try:
        trainer.fit(NoForwardLM("list-tied") if module == "no_forward" else IteratedSequentialLM())
    except ValueError as error:
        return str(error)
    return "trained"


@pytest.mark.faults
def test_tied_children_without_a_module_forward_are_refused_naming_the_fix():
    for message in run_on_ranks(2, _refused_case, "no_forward"):
        assert "children share parameters" in message and "define forward and call self(...)" in message, message


class IteratedSequentialLM(NanoLM):
    """Every layer in one nn.Sequential, iterated in forward rather than called."""

    def __init__(self) -> None:
        super().__init__("list")
        self.layers = nn.Sequential(self.embed, *self.blocks, self.head)
        del self.embed, self.blocks, self.head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = tokens
        for layer in self.layers:
            h = layer(h)
        return h


@pytest.mark.faults
def test_an_iterated_sequential_root_unit_is_an_error_naming_the_fix():
    """The nn.Sequential is the root unit (the child training_step calls): iterated, its forward never gathers the
    embedding's and the head's weights. It was PyTorch's 'aten.embedding.default got mixed torch.Tensor and
    DTensor'."""
    for message in run_on_ranks(2, _refused_case, "iterated_sequential"):
        assert "layers.0 (Embedding) was called outside the forward of layers, an nn.Sequential" in message, message
        assert "Call it (layers(x))" in message


CLI_CONFIG = """
trainer:
  accelerator: cpu
  devices: 4
  max_steps: 2
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  strategy:
    class_path: lightning_ndclip.NDParallelStrategy
    init_args:
      dp_shard: 2
      tp: 2
      loss_normalization: token_mean
      summary: false
      plan:
        class_path: lightning_ndclip.ParallelPlan
        init_args:
          fsdp_units: [test_lightning_layouts.Block]
          tp_plan:
            blocks.*.up: {class_path: torch.distributed.tensor.parallel.ColwiseParallel}
            blocks.*.down: {class_path: torch.distributed.tensor.parallel.RowwiseParallel}
model:
  class_path: test_lightning_layouts.NanoLM
  init_args:
    container: list
"""


def _cli_case(path: str) -> dict:
    from lightning.pytorch.cli import LightningCLI

    use_existing_process_group()
    cli = LightningCLI(args=["fit", "--config", path], save_config_callback=None, seed_everything_default=False)
    return {n: p.detach().full_tensor() for n, p in cli.model.named_parameters()}


def test_lightning_cli_configures_the_strategy_and_its_plan_from_yaml(tmp_path):
    """``class_path: lightning_ndclip.NDParallelStrategy`` with a nested ``ParallelPlan`` (module classes and
    ParallelStyles by import path) trains as the same strategy built in Python: equal to one device."""
    pytest.importorskip("jsonargparse")
    path = tmp_path / "config.yaml"
    path.write_text(CLI_CONFIG)
    reference = _reference("list")
    # the CLI's run keeps DTensors alive that no Python object refers to (so no clean-up reaches their meshes and
    # gloo groups): the pool is replaced after it
    for params in run_on_ranks(4, _cli_case, str(path), retire_pool=True):
        assert params.keys() == reference.keys()
        for name, expected in reference.items():
            torch.testing.assert_close(params[name], expected, rtol=1e-10, atol=1e-12, msg=name)
