"""``loss_share``, the one rule that scales a micro-batch's loss to its share of the global mean
(used by the strategy, its pipeline glue and ``TokenCount.normalize`` / ``SampleWeights.normalize``).
One process: the counts are built directly, as ``sync_token_count`` returns them."""

from __future__ import annotations

import pytest
import torch

from lightning_ndclip import SampleWeights, TokenCount, loss_share


def _count(total: int, invalid: int = 0) -> TokenCount:
    t = torch.tensor(total)
    return TokenCount(total=t, empty=t == 0, invalid=torch.tensor(invalid))


def test_every_form_of_a_micro_batch_loss_gives_the_same_share_of_the_global_mean():
    torch.manual_seed(0)
    per_token = torch.rand(3, 5, dtype=torch.float64)
    per_token[0, :2] = 0.0  # ignored tokens carry 0, as cross_entropy(reduction="none") gives them
    local = torch.tensor(13)  # valid tokens of this micro-batch; the whole step has 40
    count = _count(40)
    expected = per_token.sum() / 40
    shares = [
        loss_share(per_token, count),
        loss_share(per_token.sum() / 13, count, local_tokens=local, reduction="mean"),
        loss_share(per_token.sum(), count, reduction="sum"),
        count.normalize(per_token.sum()),
    ]
    for share in shares:
        torch.testing.assert_close(share, expected, rtol=1e-12, atol=0)
    naive = per_token.sum() / 13  # the micro-batch's own mean: what DDP-style averaging weights by
    assert not torch.isclose(naive, expected)


def test_per_sample_weights_scale_per_token_losses():
    losses = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    weights = SampleWeights(
        weights=[torch.tensor([[0.25, 0.25, 0.5]], dtype=torch.float64)],
        tokens_per_sample=[torch.tensor([2, 1])],
        num_samples=torch.tensor(2),
        local_samples=torch.tensor(2),
        empty=torch.tensor(False),
    )
    expected = torch.tensor(0.25 + 0.5 + 1.5, dtype=torch.float64)
    torch.testing.assert_close(loss_share(losses, weights.weights[0]), expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(weights.normalize(losses, 0), expected, rtol=1e-12, atol=0)


def test_no_token_anywhere_gives_zero_and_an_invalid_count_gives_nan():
    loss = torch.tensor(0.0, requires_grad=True)
    assert loss_share(loss, _count(0), reduction="sum").item() == 0.0
    assert loss_share(torch.tensor(2.0), _count(0), local_tokens=torch.tensor(0), reduction="mean").item() == 0.0
    assert torch.isnan(loss_share(torch.tensor(2.0), _count(4, invalid=1), reduction="sum"))


def test_losses_that_cannot_be_scaled_exactly_are_refused_naming_their_source():
    with pytest.raises(ValueError, match="pipeline_loss must return per-token losses.*mean cannot be weighted"):
        loss_share(torch.tensor(1.0), _count(4), reduction="mean", source="pipeline_loss")
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'max'"):
        loss_share(torch.tensor(1.0), _count(4), reduction="max")
    with pytest.raises(ValueError, match=r"training_step must return per-token losses shaped like .* \(2, 3\), got \(2,\)"):
        loss_share(torch.ones(2), torch.ones(2, 3), source="training_step")
    with pytest.raises(ValueError, match="shaped like"):
        SampleWeights([torch.ones(2, 3)], [torch.ones(1)], torch.tensor(1), torch.tensor(1), torch.tensor(False)).normalize(
            torch.ones(3)
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_losses_keep_their_share_and_gradients_for_large_counts(dtype):
    """A float16 count above 65504 is inf and a float16 weight below ~6e-8 is 0: computed in the
    loss's dtype, the share and every gradient were 0. The share is computed in float32."""
    n = 100_000
    per_token = torch.full((n,), 1.5, dtype=dtype, requires_grad=True)
    share = loss_share(per_token, _count(n))
    assert share.dtype == dtype
    torch.testing.assert_close(share.double(), torch.tensor(1.5, dtype=torch.float64), rtol=1e-2, atol=0)
    share.backward()
    torch.testing.assert_close(per_token.grad.double(), torch.full((n,), 1.0 / n, dtype=torch.float64), rtol=1e-2, atol=0)

    mean = loss_share(torch.tensor(1.5, dtype=dtype), _count(n), local_tokens=torch.tensor(n), reduction="mean")
    torch.testing.assert_close(mean.double(), torch.tensor(1.5, dtype=torch.float64), rtol=1e-2, atol=0)

    weights = torch.full((4096,), 1.0 / (512 * 100_000), dtype=torch.float64)  # 512 samples of 1e5 tokens
    losses = torch.full((4096,), 2.0, dtype=dtype)
    weighted = loss_share(losses, weights)
    torch.testing.assert_close(weighted.double(), (2.0 * weights).sum(), rtol=1e-2, atol=0)


def test_a_micro_batch_share_applies_the_rule_and_narrows_to_a_pipelines_rows():
    """MicroBatchShare, the value the strategy and its pipeline take: its three forms; a pipeline's rows take
    their weights, and a token-mean share loses its local count there (a scalar mean over rows is refused)."""
    from lightning_ndclip.core.loss import MicroBatchShare

    per_token = torch.rand(4, 3, dtype=torch.float64)
    share = MicroBatchShare(_count(40), local_tokens=torch.tensor(12))
    assert torch.equal(share.apply(per_token.mean()), per_token.sum() / 40)  # a mean over its 12 tokens
    with pytest.raises(ValueError, match="pipeline_loss"):
        share.of_rows(None).apply(per_token.mean(), source="pipeline_loss")
    weights = torch.rand(4, 3, dtype=torch.float64)
    rows = torch.tensor([1, 3])
    assert torch.equal(MicroBatchShare(weights).of_rows(rows).apply(per_token[rows]), (per_token[rows] * weights[rows]).sum())
    assert torch.equal(MicroBatchShare(0.25).apply(per_token), per_token.sum() * 0.25)  # a mean of means' factor
