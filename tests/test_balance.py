"""The load-balancing loss of the global micro-batch (``lightning_ndclip.core.load_balance``), without Lightning.

On one process it is transformers' ``aux_loss``. On 4 ranks (FSDP2 over dp_shard=4; and dp_shard=4 x ep=2 with the
model's own expert-parallel plan), each rank forwarding 2 of the 8 rows of a global micro-batch with uneven padding,
the shares add up to the one-device loss of the 8 rows and their gradients, summed by FSDP2, to its gradient, in
float64 to 1e-10; transformers' per-rank loss, summed or averaged over the ranks, fails the same check."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks
from hf_families import tiny_causal_lm
from host_reads import no_host_reads
from torch.nn import functional as F

import lightning_ndclip as nd
from lightning_ndclip.core.load_balance import (
    LoadBalance,
    PooledRouting,
    experts_of,
    load_balance,
    load_balancing_loss,
    max_over_mean,
    window_share,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(  # releases before model.ep_plan (5.0, the floor) also return float32 router logits
    not hasattr(transformers.PreTrainedModel, "ep_plan"), reason="this transformers release has no model.ep_plan"
)

ROWS, LENGTH, RANKS = 8, 6, 4
FAMILIES = ["Mixtral", "Qwen3-MoE"]


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8 rows of 6 tokens, their attention mask and labels: padding of very different lengths (row 5 all padding),
    and rows 6 and 7 (rank 3's) routed but without a label (a prompt: no loss token on that rank)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 32, (ROWS, LENGTH), generator=g)
    mask = torch.ones(ROWS, LENGTH, dtype=torch.long)
    for row, pad in enumerate([0, 3, 1, 5, 0, LENGTH, 1, 0]):
        mask[row, LENGTH - pad :] = 0
    labels = torch.where(mask > 0, torch.randint(3, 32, (ROWS, LENGTH), generator=g), -100)
    labels[6:] = -100
    return ids, mask, labels


def _model(family: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    model = tiny_causal_lm(family).to(dtype)
    model.set_experts_implementation("eager")  # the grouped matmul kernels have no float64
    return model


def transformers_aux(router_logits, num_experts: int, top_k: int, mask: torch.Tensor | None) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` written out in the logits' dtype (its own sums are float32): the
    layers' logits concatenated, f and P over every counted (layer, token) row."""
    logits = torch.cat([t.reshape(-1, num_experts) for t in router_logits])
    probabilities = torch.softmax(logits, dim=-1)
    chosen = F.one_hot(torch.topk(probabilities, top_k, dim=-1).indices, num_experts).to(logits.dtype)  # [rows, K, E]
    layers = len(router_logits)
    weight = torch.ones(len(logits), dtype=logits.dtype) if mask is None else mask.reshape(-1).to(logits.dtype).repeat(layers)
    fractions = (chosen * weight[:, None, None]).sum(0) / weight.sum()  # [K, E]
    mean_probability = (probabilities * weight[:, None]).sum(0) / weight.sum()
    return num_experts * (fractions * mean_probability).sum()


COEF = 0.5
"""The load-balancing loss's weight (transformers' ``router_aux_loss_coef``), large for its gradient to show."""


def _one_device(family: str, cross_entropy: bool = True) -> dict:
    """The 8 rows forwarded at once on one process, float64: the token-mean cross-entropy plus ``COEF`` times the
    load-balancing loss (what the model's own ``loss`` is with ``output_router_logits=True``; or the latter alone),
    and every gradient."""
    model = _model(family)
    ids, mask, labels = _batch()
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    ce = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    aux = transformers_aux(out.router_logits, *experts_of(model), mask)
    (ce + COEF * aux if cross_entropy else aux).backward()
    return {"aux": aux.detach(), "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


# --- one process ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["Mixtral", "Qwen3-MoE", "Qwen2-MoE", "OLMoE", "GPT-OSS", "ERNIE-4.5-MoE"])
def test_on_one_process_it_is_transformers_aux_loss(family):
    """The model's own ``aux_loss`` (float32), its value and its gradient, with padding."""
    model = tiny_causal_lm(family)
    ids, mask, _ = _batch()
    out = model(input_ids=ids[:6], attention_mask=mask[:6], output_router_logits=True)
    ours = nd.load_balancing_loss(out.router_logits, model, attention_mask=mask[:6])
    torch.testing.assert_close(ours, out.aux_loss, rtol=1e-6, atol=0)
    params = [p for p in model.parameters() if p.requires_grad]
    expected = torch.autograd.grad(out.aux_loss, params, retain_graph=True, allow_unused=True)
    got = torch.autograd.grad(ours, params, allow_unused=True)
    for e, g in zip(expected, got):
        assert (e is None) == (g is None)
        if e is not None:
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_without_a_mask_every_token_counts_and_the_logits_dtype_is_kept():
    model = _model("Mixtral")
    out = model(input_ids=_batch()[0], output_router_logits=True)
    ours = load_balancing_loss(out.router_logits, 4, 2)
    assert ours.dtype == out.router_logits[0].dtype  # float64 (transformers 5.0's router returns float32 logits)
    torch.testing.assert_close(ours, transformers_aux(out.router_logits, 4, 2, None), rtol=1e-13, atol=0)


def test_the_expert_load_is_the_pairs_per_expert_and_layer():
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0], [2.0, 3.0, 0.0, -1.0], [5.0, 0.0, 4.0, 0.0]])  # the last one padding
    mask = torch.tensor([[1, 1, 0]])
    balance = load_balance((logits, logits.flip(-1)), 4, 2, mask)
    assert balance.expert_load.tolist() == [[2, 2, 0, 0], [0, 0, 2, 2]]
    assert int(balance.tokens) == 2
    torch.testing.assert_close(balance.imbalance, torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(max_over_mean(torch.zeros(2, 4, dtype=torch.int64)), torch.zeros(2))


def test_no_counted_token_gives_zero_and_no_nan():
    """transformers divides 0 by 0 there; here the loss and every gradient are 0."""
    logits = torch.randn(6, 4, requires_grad=True)
    loss = load_balancing_loss((logits,), 4, 2, torch.zeros(2, 3))
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(logits.grad.abs().max()) == 0.0


def test_it_reads_nothing_on_the_host():
    logits = torch.randn(12, 4, requires_grad=True)
    with no_host_reads():
        balance = load_balance((logits, logits * 2), 4, 2, torch.ones(3, 4))
        balance.loss.backward()
        balance.imbalance.max()


def test_what_it_refuses_says_why():
    logits = torch.randn(6, 4)
    with pytest.raises(ValueError, match="output_router_logits=True"):
        load_balancing_loss(None, 4, 2)
    with pytest.raises(ValueError, match="attention_mask has 4 entries but the router saw 6 tokens"):
        load_balancing_loss((logits,), 4, 2, torch.ones(2, 2))
    with pytest.raises(ValueError, match="4 logits per token, not num_experts=8"):
        load_balancing_loss((logits,), 8, 2)
    with pytest.raises(ValueError, match="top_k=5 must be in 1 .. num_experts=4"):
        load_balancing_loss((logits,), 4, 5)
    with pytest.raises(ValueError, match="names no expert count"):
        experts_of(tiny_causal_lm("Llama").config)
    assert experts_of(tiny_causal_lm("Qwen3-MoE").config) == (4, 2)
    with pytest.raises(ValueError, match="must be a 0-dim tensor"):
        window_share(torch.ones(2), 2)


def test_pieces_replayed_with_pooled_statistics_equal_the_batch_forwarded_at_once():
    """What VerifyOneDevice does on one process: each data rank's micro-batch forwarded on its own, first to sum the
    statistics, then with them; the shares add up to the loss of the rows forwarded at once, and so do their
    gradients (float64, 1e-12). Two global micro-batches (keys) kept apart."""
    reference = _one_device("Mixtral", cross_entropy=False)
    model = _model("Mixtral")
    ids, mask, _ = _batch()
    pool = PooledRouting()

    def step(rows: slice) -> torch.Tensor:
        out = model(input_ids=ids[rows], attention_mask=mask[rows], output_router_logits=True)
        return load_balancing_loss(out.router_logits, model, attention_mask=mask[rows], group=None)

    pieces = [slice(2 * r, 2 * r + 2) for r in range(RANKS)]
    other = slice(0, 3)  # another micro-batch's piece, recorded under another key
    for key, rows in [(0, p) for p in pieces] + [(1, other)]:
        with pool.record(key), torch.no_grad():
            step(rows)
    assert pool.used
    total = torch.zeros((), dtype=torch.float64)
    for rows in pieces:
        with pool.apply(0):
            share = step(rows)
        share.backward()
        total += share.detach()
    torch.testing.assert_close(total, reference["aux"], rtol=1e-12, atol=0)
    for name, expected in reference["grads"].items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, expected, rtol=1e-10, atol=1e-14, msg=name)
    with pool.apply(2), pytest.raises(ValueError, match="was not recorded alike"):
        step(other)


# --- 4 ranks ----------------------------------------------------------------------------------------------------


def _parallel_case(family: str, ep: int, which: str, tp: int = 1) -> dict:
    """Each data rank forwards its rows of the global micro-batch (rank r of 4: rows 2r, 2r + 1) on a FSDP2 model
    (experts over ep when ep > 1; attention and experts split over tp when tp > 1, tp peers holding the same rows),
    every reduction a SUM, and backpropagates its share of the token-mean cross-entropy plus ``COEF`` times ``which``
    load-balancing loss: ``"global"`` (its share of the global micro-batch's), ``"per_rank"`` (transformers' loss of
    its own rows, as the model's ``aux_loss``) or ``"per_rank_mean"`` (the same over the ranks: the per-rank losses
    averaged, as an averaging reduction would)."""
    dp = RANKS // tp
    meshes = nd.ParallelDims(world_size=RANKS, dp_shard=dp, tp=tp, ep=ep).build_mesh("cpu")
    model = _model(family)
    layer = type(model.model.layers[0])
    nd.ParallelPlan(tp_plan="auto" if ep > 1 or tp > 1 else None, fsdp_units=[layer]).apply(model, meshes)
    nd.use_sum_reduction(model)
    rank, rows = meshes["dp"].get_local_rank(), ROWS // dp
    ids, mask, labels = (t[rows * rank : rows * (rank + 1)] for t in _batch())
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    count = nd.sync_token_count(nd.count_valid_tokens(labels), group=meshes["dp_cp"].get_group())
    ce = count.normalize(F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"))
    load = None
    if which == "global":
        balance = load_balance(out.router_logits, model, attention_mask=mask, group=meshes)
        aux, load = balance.loss, balance.expert_load
    else:
        aux = transformers_aux(out.router_logits, *experts_of(model), mask) / (dp if which == "per_rank_mean" else 1)
    (ce + COEF * aux).backward()
    total = aux.detach().clone()
    dist.all_reduce(total, group=meshes["dp_cp"].get_group())
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    experts = {p.device_mesh.mesh_dim_names for n, p in model.named_parameters() if ".experts." in n}
    return {"aux": total, "grads": grads, "load": load, "experts_meshes": experts}


def _worst(grads: dict, reference: dict) -> float:
    """The largest gradient error relative to the reference's total norm."""
    norm = torch.sqrt(sum(g.square().sum() for g in reference.values()))
    assert grads.keys() == reference.keys(), set(grads) ^ set(reference)
    return max(float((grads[n] - g).norm() / norm) for n, g in reference.items())


@pytest.mark.parametrize("ep", [1, 2], ids=["fsdp2", "fsdp2_ep2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_global_loss_on_4_ranks_equals_one_device_and_the_per_rank_one_does_not(family, ep):
    reference = _one_device(family)
    results = run_on_ranks(RANKS, _parallel_case, family, ep, "global")
    if ep > 1:
        assert results[0]["experts_meshes"] == {("edp", "ep")}
    for result in results:
        torch.testing.assert_close(result["aux"], reference["aux"], rtol=1e-10, atol=0)
        assert _worst(result["grads"], reference["grads"]) < 1e-10
        assert torch.equal(result["load"], results[0]["load"])
    # transformers' loss of each rank's own rows: neither its sum (a SUM reduction) nor its mean (an averaging one)
    for which in ("per_rank", "per_rank_mean"):
        result = run_on_ranks(RANKS, _parallel_case, family, ep, which)[0]
        assert _worst(result["grads"], reference["grads"]) > 1e-3, which  # 0.28-0.34 summed, 0.05 averaged
        assert abs(float(result["aux"] / reference["aux"]) - 1) > 1e-4, which  # 3.0 summed, 1e-3 averaged


def test_tensor_parallel_peers_hold_the_same_tokens_and_are_not_summed_over():
    """dp_shard=2 x tp=2 x ep=2 (the model's own plans): the data ranks are the 2 dp ranks; the loss and every
    gradient equal one device's in float64."""
    reference = _one_device("Qwen3-MoE")
    results = run_on_ranks(RANKS, _parallel_case, "Qwen3-MoE", 2, "global", 2)
    assert results[0]["experts_meshes"] == {("edp", "ep", "tp")}
    for result in results:
        torch.testing.assert_close(result["aux"], reference["aux"], rtol=1e-10, atol=0)
        assert _worst(result["grads"], reference["grads"]) < 1e-10


def _group_case() -> list[float]:
    """The same logits on every rank of a 2 x 2 mesh, summed over one dim (2 ranks) and over the world (4)."""
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    logits = torch.arange(24, dtype=torch.float64).reshape(6, 4).sin()
    loads = [load_balance((logits,), 4, 2, group=g) for g in (mesh["b"], mesh["b"].get_group(), None)]
    alone = transformers_aux((logits,), 4, 2, None)
    assert isinstance(loads[0], LoadBalance)
    return [float(b.loss / alone) for b in loads] + [int(loads[0].tokens), int(loads[2].tokens)]


def test_the_group_may_be_a_mesh_a_process_group_or_the_world():
    """With identical copies on every rank, each rank's share is 1 / (ranks summed over) of one copy's loss."""
    for result in run_on_ranks(RANKS, _group_case):
        assert result == pytest.approx([0.5, 0.5, 0.25, 12, 24])
