"""The norm, the clip and the loss normalization never read a value on the host: they run on
``meta`` tensors, which hold no data, so any host read (``.item()``, ``bool()``, ``.tolist()``, a
copy to the CPU, an output sized by the data) raises.

This is the CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: a host read there is a
device synchronization. (Without a process group; the one all-reduce of a distributed call runs on
the gradients' device with NCCL, on the CPU with gloo.)
"""

from __future__ import annotations

import math

import pytest
import torch

import lightning_ndclip as nd


def _meta_params(buffer_views: bool) -> list[torch.nn.Parameter]:
    shapes = [(5, 3), (7,), (2, 2, 2)]
    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in shapes]
    if buffer_views:  # as FSDP2 lays out a unit's gradients: views of one flat buffer
        flat = torch.empty(sum(p.numel() for p in params), device="meta")
        at = 0
        for p in params:
            p.grad = flat[at : at + p.numel()].view(p.shape)
            at += p.numel()
    else:
        for p in params:
            p.grad = torch.empty_like(p)
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 0.5, math.inf])
@pytest.mark.parametrize("buffer_views", [False, True], ids=["tensors", "buffer-views"])
def test_norm_and_clip_read_nothing_on_the_host(norm_type, buffer_views):
    params = _meta_params(buffer_views)
    total = nd.clip_grad_norm_(params, 1.0, norm_type)
    assert total.device.type == "meta" and total.shape == ()
    norm = nd.get_total_norm([p.grad for p in params], norm_type, accumulate_dtype=torch.float64)
    nd.clip_grads_with_norm_(params, 1.0, norm)
    norms = nd.grad_norms([(f"p{i}", p) for i, p in enumerate(params)], norm_type)
    assert norms.per_tensor is not None and norms.per_tensor.device.type == "meta"


def test_error_if_nonfinite_reads_the_host_and_is_caught_here():
    """The check above can fail: ``error_if_nonfinite=True`` must read the norm on the host."""
    with pytest.raises((NotImplementedError, RuntimeError), match="meta"):
        nd.clip_grad_norm_(_meta_params(False), 1.0, error_if_nonfinite=True)


def test_loss_normalization_reads_nothing_on_the_host():
    """The token count and the hierarchical sample weights stay device tensors too (``bincount`` or
    boolean indexing would read the ids' maximum or count on the host: both raise on meta)."""
    labels = torch.empty(2, 6, dtype=torch.int64, device="meta")
    count = nd.sync_token_count(nd.count_valid_tokens(labels))
    assert count.total.device.type == "meta"
    ids = [torch.empty(2, 6, dtype=torch.int64, device="meta"), torch.empty(1, 6, dtype=torch.int32, device="meta")]
    valid = [torch.empty(2, 6, dtype=torch.bool, device="meta"), torch.empty(1, 6, dtype=torch.bool, device="meta")]
    weights = nd.sync_sample_weights(ids, [3, 1], valid)
    assert [w.shape for w in weights.weights] == [(2, 6), (1, 6)] and weights.num_samples.device.type == "meta"
    with pytest.raises((NotImplementedError, RuntimeError)):  # what the check would catch
        torch.bincount(ids[0][valid[0]])
