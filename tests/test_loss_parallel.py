"""Loss parallel (``core/parallel/loss_parallel``): cross-entropy on logits sharded along the vocabulary equals the
plain model's on one process in float64, per token, under the token mean and the sample mean, tied and untied heads,
tp=2 and dp_shard=2 x tp=2 (FSDP2); a transformers Llama's own ``.loss`` too. The naive method (each rank's
cross-entropy of its own block) is shown failing the same check. Refusals name what they refuse."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import lightning_ndclip as nd
from lightning_ndclip.core.loss import loss_share, sync_token_count
from lightning_ndclip.core.parallel.loss_parallel import (
    loss_parallel_plan,
    vocab_parallel_cross_entropy,
    vocab_parallel_head,
)

VOCAB, WIDTH = 13, 6  # 13: tp=2 splits the vocabulary unevenly (7 + 6)
PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel(), "head": ColwiseParallel(output_layouts=Replicate())}


class TinyLM(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(h + self.down(torch.tanh(self.up(h))))


def _model(tied: bool) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(tied).double()


def _data(rows: int = 4, seq: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, labels (some -100, unevenly over the rows), and sample ids (2 samples per row, -1 on ignored)."""
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, VOCAB, (rows, seq), generator=g), torch.randint(0, VOCAB, (rows, seq), generator=g)
    labels[0, :3] = -100
    labels[3, 1] = -100
    ids = torch.tensor([0, 0, 1, 1, 1]).repeat(rows, 1) + 2 * torch.arange(rows)[:, None]
    return tokens, labels, torch.where(labels == -100, -1, ids)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[name] = grad.detach().clone()
        p.grad = None
    return out


def _sample_weights(labels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """1 / (B T_b) per valid token: the hierarchical mean's weights over the tokens given."""
    valid = labels != -100
    tokens_per = torch.bincount(ids[valid], minlength=int(ids.max()) + 1).double()
    samples = (tokens_per > 0).sum()
    return torch.where(valid, 1.0 / (samples * tokens_per[ids.clamp(min=0)]), 0.0)


def _one_device(tied: bool, rows: slice | None = None) -> dict:
    """Per-token losses, and the token-mean and sample-mean gradients, of the plain model on the whole batch."""
    model = _model(tied)
    tokens, labels, ids = _data()
    losses = nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    (losses.sum() / (labels != -100).sum()).backward()
    token_mean = _grads(model)
    losses = nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    (losses * _sample_weights(labels, ids)).sum().backward()
    return {"losses": losses.detach(), "token_mean": token_mean, "sample_mean": _grads(model)}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative difference over the gradients of ``a`` and ``b``."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in a)


def _tp_case(tied: bool, naive: bool) -> dict:
    """tp=2 on 2 ranks: the head loss-parallel, per-token losses from the shards; ``naive``: the plain colwise head
    (each rank its block, a plain tensor) and ``F.cross_entropy`` of the block."""
    mesh = nd.ParallelDims(world_size=2, tp=2).build_mesh("cpu")
    model = _model(tied)
    plan = {**PLAN, "head": ColwiseParallel()} if naive else loss_parallel_plan(model, PLAN)
    nd.tensor_parallelize(model, mesh["tp"], plan)
    tokens, labels, ids = _data()

    def per_token() -> torch.Tensor:
        logits = model(tokens)
        if naive:
            flat = logits.flatten(0, 1)
            return nn.functional.cross_entropy(flat, labels.flatten().clamp(max=flat.shape[-1] - 1), reduction="none",
                                               ignore_index=-100).view(labels.shape)  # fmt: skip
        assert isinstance(logits, DTensor) and logits.to_local().shape[-1] == (7, 6)[dist.get_rank()]
        return vocab_parallel_cross_entropy(logits, labels)

    count = sync_token_count((labels != -100).sum(), group=mesh["dp_cp"].get_group())
    losses = per_token()
    loss_share(losses, count).backward()
    token_mean = _grads(model)
    loss_share(per_token(), _sample_weights(labels, ids)).backward()
    result = {"losses": losses.detach(), "token_mean": token_mean, "sample_mean": _grads(model)}
    if not naive:
        result["tied"] = model.head.weight is model.embed.weight
        losses = vocab_parallel_cross_entropy(model(tokens), labels)
        losses.sum().backward(retain_graph=True)
        try:
            losses.sum().backward()
        except RuntimeError as error:
            result["second_backward"] = str(error)
        bad = labels.clone()
        bad[1, 1] = VOCAB
        try:
            vocab_parallel_cross_entropy(model(tokens), bad)
        except ValueError as error:
            result["out_of_range"] = str(error)
    return result


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tp2_per_token_losses_and_gradients_equal_one_device_and_the_naive_block_loss_does_not(tied):
    expected = _one_device(tied)
    got = run_on_ranks(2, _tp_case, tied, False)
    for result in got:
        assert torch.allclose(result["losses"], expected["losses"], rtol=1e-12, atol=1e-12)
        assert _close(result["token_mean"], expected["token_mean"]) < 1e-10
        assert _close(result["sample_mean"], expected["sample_mean"]) < 1e-10
        assert result["tied"] is tied
        assert "modified by an inplace operation" in result["second_backward"]
        assert "labels must lie in [0, 13)" in result["out_of_range"]
    naive = run_on_ranks(2, _tp_case, tied, True)[0]
    assert not torch.allclose(naive["losses"], expected["losses"], rtol=1e-3)
    assert _close(naive["token_mean"], expected["token_mean"]) > 1e-2
    assert _close(naive["sample_mean"], expected["sample_mean"]) > 1e-2


def _fsdp_tp_case() -> dict:
    """dp_shard=2 x tp=2 on 4 ranks, FSDP2 with SUM reduction: each dp rank two rows (different valid counts), the
    token mean over the global count, tied head."""
    dims = nd.ParallelDims(world_size=4, dp_shard=2, tp=2)
    meshes = dims.build_mesh("cpu")
    model = _model(True)
    nd.parallelize(model, meshes, tp_plan=loss_parallel_plan(model, PLAN))
    nd.use_sum_reduction(model)
    tokens, labels, _ = _data()
    mine = slice(2 * meshes["dp"].get_local_rank(), 2 * meshes["dp"].get_local_rank() + 2)
    count = sync_token_count((labels[mine] != -100).sum(), group=meshes["dp_cp"].get_group())
    loss_share(vocab_parallel_cross_entropy(model(tokens[mine]), labels[mine]), count).backward()
    return {"token_mean": _grads(model), "tied": model.head.weight is model.embed.weight}


def test_fsdp2_by_tp2_token_mean_gradients_equal_one_device():
    expected = _one_device(True)["token_mean"]
    for result in run_on_ranks(4, _fsdp_tp_case):
        assert result["tied"]
        assert _close(result["token_mean"], expected) < 1e-10


# --- transformers: a tiny Llama's own .loss under tp_plan="auto" + loss parallel


def _llama(tied: bool) -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def _llama_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 37, (2, 7), generator=g)
    labels = tokens.clone()
    labels[0, :3] = -100
    return tokens, labels


def _llama_run(model: nn.Module) -> dict:
    """The model's own .loss as a mean (no num_items_in_batch) and as a sum over a given count; gradients of both."""
    tokens, labels = _llama_batch()
    out = model(input_ids=tokens, labels=labels)
    out.loss.backward()
    mean = _grads(model)
    count = (labels[:, 1:] != -100).sum()
    summed = model(input_ids=tokens, labels=labels, num_items_in_batch=count).loss
    (summed * 3).backward()
    return {"loss": out.loss.detach(), "summed": summed.detach(), "mean": mean, "sum": _grads(model), "logits": out.logits}


def _llama_tp_case(tied: bool) -> dict:
    from lightning_ndclip.integrations.transformers.plans import hf_tp_plan

    mesh = nd.ParallelDims(world_size=2, tp=2).build_mesh("cpu")
    model = _llama(tied)
    plan = loss_parallel_plan(model, hf_tp_plan(model, tp=2))
    nd.tensor_parallelize(model, mesh["tp"], plan)
    result = _llama_run(model)
    logits = result.pop("logits")
    result["local_vocab"] = logits.to_local().shape[-1] if isinstance(logits, DTensor) else None
    result["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    return result


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_tp2_own_loss_on_the_shards_equals_one_device(tied):
    pytest.importorskip("transformers")
    from lightning_ndclip.integrations.transformers.plans import vocab_parallel_causal_lm_loss

    own = _llama_run(_llama(tied))  # transformers' ForCausalLMLoss: float32, whatever the logits' dtype
    reference = _llama(tied)
    reference.loss_function = vocab_parallel_causal_lm_loss  # the same loss on plain logits, in float64
    expected = _llama_run(reference)
    assert abs(float(expected["loss"] - own["loss"])) < 1e-6 * float(own["loss"])
    for result in run_on_ranks(2, _llama_tp_case, tied):
        assert result["tied"] is tied and result["local_vocab"] in (19, 18)  # 37 = 19 + 18
        for key in ("loss", "summed"):
            assert abs(float(result[key] - expected[key])) < 1e-12 * float(expected[key])
        assert _close(result["mean"], expected["mean"]) < 1e-10
        assert _close(result["sum"], expected["sum"]) < 1e-10


# --- refusals, on one process


def test_the_head_is_found_or_named_and_a_plan_without_one_is_refused():
    model = _model(False)
    assert loss_parallel_plan(model, PLAN)["head"].use_local_output is False
    with pytest.raises(ValueError, match="found none; name it"):
        loss_parallel_plan(model, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    two = {**PLAN, "up": ColwiseParallel(output_layouts=Replicate())}
    with pytest.raises(ValueError, match=r"found \['up', 'head'\]"):
        loss_parallel_plan(model, two)
    assert loss_parallel_plan(model, two, "head")["up"] is two["up"]
    with pytest.raises(ValueError, match="must be a ColwiseParallel style on nn.Linear"):
        loss_parallel_plan(model, PLAN, "down")
    with pytest.raises(ValueError, match="needs tp > 1"):
        loss_parallel_plan(model, None)


def test_plain_logits_are_plain_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(3, 4, 5, generator=g), torch.randint(0, 5, (3, 4), generator=g)
    labels[0, 0] = -100
    plain = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(3, 4)
    assert torch.equal(vocab_parallel_cross_entropy(logits, labels), plain)
    assert torch.allclose(vocab_parallel_cross_entropy(logits, labels, reduction="mean"), plain.sum() / 11)
    with pytest.raises(ValueError, match="shaped like the logits"):
        vocab_parallel_cross_entropy(logits, labels[:, :2])
    assert vocab_parallel_head().output_layouts[0].dim == -1


def test_llama_refusals_name_the_cause():
    pytest.importorskip("transformers")
    from lightning_ndclip.integrations.transformers.plans import hf_tp_plan, vocab_parallel_causal_lm_loss

    model = _llama(False)
    model.loss_function = lambda **kwargs: 0
    with pytest.raises(ValueError, match="loss_function is <lambda>.*ForCausalLMLoss only"):
        loss_parallel_plan(model, hf_tp_plan(model, tp=2))
    logits = torch.randn(2, 1, 37)  # logits_to_keep=1 with labels
    with pytest.raises(ValueError, match="logits_to_keep"):
        vocab_parallel_causal_lm_loss(logits, torch.zeros(2, 7, dtype=torch.int64), vocab_size=37)

    class OwnLoss(type(model)):  # type: ignore[misc]
        def forward(self, input_ids, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids)
            out.loss = out.logits.sum()
            return out

    class ShippedWithOwnLoss(type(model)):  # type: ignore[misc]  # as transformers 5.0's Gemma 3 causal LM
        __module__ = "transformers.models.shipped"

        def forward(self, input_ids, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids)
            out.loss = nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            return out

    with pytest.raises(ValueError, match="ShippedWithOwnLoss's forward computes its .loss with code of its own"):
        loss_parallel_plan(ShippedWithOwnLoss(model.config), hf_tp_plan(model, tp=2))  # before any change

    model = OwnLoss(model.config)  # yours: its transformers class calls loss_function, the subclass is watched
    loss_parallel_plan(model, hf_tp_plan(model, tp=2))  # no collective: installs the loss, rewrites the plan
    tokens, labels = _llama_batch()
    with pytest.raises(ValueError, match="returned a .loss without calling its loss_function"):
        model(tokens, labels=labels)


def _bf16_logits() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    logits = (4 * torch.randn(3, 5, 301, generator=g)).to(torch.bfloat16)  # 301: blocks of 151 and 150
    labels = torch.randint(0, 301, (3, 5), generator=g)
    labels[0, :2] = -100
    return logits, labels


def _bf16_case() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    logits, labels = _bf16_logits()
    local = logits.tensor_split(2, dim=-1)[dist.get_rank()].clone().requires_grad_()
    sharded = DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=logits.shape, stride=logits.stride())
    losses = vocab_parallel_cross_entropy(sharded, labels)
    losses.sum().backward()
    return {"losses": losses.detach(), "dtype": str(losses.dtype), "grad": local.grad, "grad_dtype": str(local.grad.dtype)}


def test_bf16_logits_give_transformers_float32_loss_and_a_bf16_gradient():
    """transformers upcasts the logits to float32 for its loss; the shards do the same, and hand back the logits'
    gradient in their dtype, as autograd through ``.float()`` does."""
    logits, labels = _bf16_logits()
    whole = logits.clone().requires_grad_()
    expected = nn.functional.cross_entropy(whole.float().flatten(0, 1), labels.flatten(), reduction="none").view(3, 5)
    expected.sum().backward()
    results = run_on_ranks(2, _bf16_case)
    for rank, result in enumerate(results):
        assert result["dtype"] == "torch.float32" and result["grad_dtype"] == "torch.bfloat16"
        torch.testing.assert_close(result["losses"], expected.detach(), rtol=1e-6, atol=1e-6)
        block = whole.grad.tensor_split(2, dim=-1)[rank]
        torch.testing.assert_close(result["grad"].float(), block.float(), rtol=8e-3, atol=1e-7)  # one bf16 ulp
