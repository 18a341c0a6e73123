"""Attention dropout over tensor-parallel heads (``lightning_ndclip.integrations.transformers.dropout``): a tiny transformers
Llama with ``attention_dropout=0.5``, its heads split over tp=2, drops out its attention probabilities with masks of
its own on each tp rank's heads, as one device draws every head's mask from its stream; without the fork the two head
groups got the same masks. The hidden states every tp rank holds whole stay alike (the shared stream is untouched)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from helpers import use_existing_process_group

transformers = pytest.importorskip("transformers")

import lightning_ndclip as nd  # noqa: E402
from lightning_ndclip import _compat  # noqa: E402
from lightning_ndclip.core.parallel.mesh import ParallelDims  # noqa: E402
from lightning_ndclip.core.parallel.plan import parallelize  # noqa: E402
from lightning_ndclip.core.random import RandomStreams  # noqa: E402
from lightning_ndclip.integrations.transformers.dropout import fork_split_head_dropout  # noqa: E402


def _llama(implementation: str) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, attention_dropout=0.5, attn_implementation=implementation,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def _masks_cases(implementation: str) -> tuple[dict, dict]:
    """The same forward without the fork and with it."""
    return _masks_case(False, implementation), _masks_case(True, implementation)


def _masks_case(forked: bool, implementation: str) -> dict:
    meshes = ParallelDims(world_size=dist.get_world_size(), tp=2).build_mesh("cpu")
    model = _llama(implementation)
    parallelize(model, meshes, tp_plan="auto")
    streams = RandomStreams(meshes, seed=7)
    streams.seed_shared()
    undo = fork_split_head_dropout(model, meshes["tp"].get_local_rank()) if forked else (lambda: None)
    kept: list[torch.Tensor] = []
    hook = model.model.layers[0].self_attn.register_forward_hook(lambda m, a, out: kept.append(out[1] != 0))
    try:
        model.train()
        tokens = torch.randint(0, 37, (2, 7), generator=torch.Generator().manual_seed(1))
        hidden = model(input_ids=tokens, output_hidden_states=True).hidden_states[-1]
        state = torch.get_rng_state()
    finally:
        hook.remove()
        undo()
        streams.restore()
    implementation_after = _compat.attention_implementation(model.config)
    return {"kept": kept[0], "hidden": hidden.detach(), "state": state, "implementation": implementation_after}


@pytest.mark.parametrize("implementation", ["eager"])
def test_each_tp_rank_draws_its_own_heads_attention_dropout(implementation):
    (naive_0, forked_0), (naive_1, forked_1) = run_on_ranks(2, _masks_cases, implementation)
    naive, forked = (naive_0, naive_1), (forked_0, forked_1)
    # without the fork: head h on rank 0 and head h + 2 on rank 1 dropped out alike (the masks are the same numbers)
    assert torch.equal(naive[0]["kept"], naive[1]["kept"])
    # forked: the two head groups' masks differ, each about half kept, as one device's heads' masks
    first, second = forked[0]["kept"], forked[1]["kept"]
    assert first.shape == second.shape == (2, 2, 7, 7) and not torch.equal(first, second)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()  # the probabilities the causal mask leaves above 0
    assert 0.3 < first[..., causal].double().mean() < 0.7 and 0.3 < second[..., causal].double().mean() < 0.7
    # what every tp rank holds whole stays alike: the hidden states, and the shared streams of the peers
    for run in (naive, forked):
        assert torch.equal(run[0]["hidden"], run[1]["hidden"])
        assert torch.equal(run[0]["state"], run[1]["state"])
    assert forked[0]["implementation"] == implementation  # undone


class _DroppingLlama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lm = _llama("eager")
        self.kept: list[torch.Tensor] = []
        self.lm.model.layers[0].self_attn.register_forward_hook(lambda m, a, out: self.kept.append(out[1].detach() != 0))

    def count_tokens(self, batch) -> torch.Tensor:
        return (batch[1][:, 1:] != -100).sum()

    def training_step(self, batch, batch_idx):
        return self.lm(input_ids=batch[0], labels=batch[1]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        tokens = torch.randint(0, 37, (4, 7), generator=torch.Generator().manual_seed(3))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, tokens), batch_size=2)


def _trainer_case(recompute: bool) -> dict:
    use_existing_process_group()
    module = _DroppingLlama()
    layers = [type(module.lm.model.layers[0])] if recompute else []
    plan = nd.ParallelPlan(tp_plan="auto", activation_checkpointing=layers)
    strategy = nd.NDParallelStrategy(tp=2, plan=plan, loss_normalization="token_mean", summary=False)
    verify = nd.VerifyOneDevice()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, accumulate_grad_batches=2, logger=False,
                        callbacks=[verify], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    return {"kept": module.kept, "report": verify.report, "implementation": _compat.attention_implementation(module.lm.config)}


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
def test_in_the_trainer_tp_ranks_draw_their_own_heads_masks_and_verify_replays_them_exactly(recompute):
    """``NDParallelStrategy(tp=2, plan=ParallelPlan(tp_plan="auto"))`` on a Llama with ``attention_dropout=0.5``: the two
    head groups' masks differ in every forward, and ``VerifyOneDevice``'s one-process replay of the step, drawing the
    ranks' masks, is exact. With the decoder layers recomputed in backward (``activation_checkpointing``) the
    recomputation draws the forward's masks again (masks from a stream that had moved on: gradients up to 170 % off), and
    the model runs without its cache in training (a recomputed layer appended its keys to the cache twice: a shape
    error in backward)."""
    first, second = run_on_ranks(2, _trainer_case, recompute)
    assert len(second["kept"]) == 2 * (1 + recompute) and len(first["kept"]) == 4 + 2 * recompute  # + the replay
    assert all(not torch.equal(a, b) for a, b in zip(first["kept"], second["kept"]))
    replay = first["kept"][-2:]
    for micro_batch, forward in enumerate((0, 1 + recompute)):  # one device's masks: the head groups' side by side
        whole = torch.cat([first["kept"][forward], second["kept"][forward]], dim=1)
        assert torch.equal(replay[micro_batch], whole)
        if recompute:  # the recomputation's masks are the forward's
            assert torch.equal(first["kept"][forward + 1], first["kept"][forward])
    assert "verdict: exact" in first["report"] and "replayed" in first["report"], first["report"]
    assert first["implementation"] == "eager"  # given back at teardown


def _compiled_plan_case() -> str:
    meshes = ParallelDims(world_size=dist.get_world_size(), tp=2).build_mesh("cpu")
    model = _llama("eager")
    plan = nd.ParallelPlan(tp_plan="auto", fsdp_units=[type(model.model.layers[0])], compile=True)
    with pytest.raises(ValueError) as info:
        plan.apply(model, meshes)
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())  # refused before
    return str(info.value)


def test_compiling_blocks_whole_with_split_head_dropout_is_refused_naming_the_way_out():
    """Dynamo failed inside the first forward ('torch.* op returned non-Tensor', on the streams' fork) on every rank."""
    for message in run_on_ranks(2, _compiled_plan_case):
        assert "LlamaForCausalLM drops out its attention probabilities" in message and "'fullgraph': False" in message
