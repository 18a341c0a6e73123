"""``core.random.RandomStreams`` on 4 CPU ranks: tensor- and context-parallel peers draw alike (a dropout mask on
replicated activations, a per-sample timestep), data ranks draw apart (with one seed everywhere, as before, they drew
the same masks and noise for their samples), a fork draws apart over the dims a tensor is split over (noise for this
cp rank's tokens) and leaves the shared stream where it was; ``restore`` gives the generator back; a rank seeded
apart (the usual ``seed + rank``) or drawing more than its peers is named on every rank. The strategy's use:
test_random_trainer.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_on_ranks

from lightning_ndclip import ParallelDims, RandomStreams


def _streams(layout: str) -> RandomStreams:
    sizes = {"dp_shard x tp": {"dp_shard": 2, "tp": 2}, "dp_shard x cp": {"dp_shard": 2, "cp": 2}}[layout]
    meshes = ParallelDims(world_size=dist.get_world_size(), **sizes).build_mesh("cpu")
    return RandomStreams(meshes, seed=7)


def _draws(layout: str) -> dict:
    streams = _streams(layout)
    before = torch.get_rng_state()
    streams.seed_shared()
    shared = torch.rand(8)  # a dropout mask's uniforms on replicated activations; a per-sample timestep
    with streams.fork(layout.rpartition(" ")[2]):
        forked = torch.randn(8)  # noise for this rank's tokens / dropout over this rank's heads
    with streams.fork(layout.rpartition(" ")[2]):
        forked_again = torch.randn(8)
    after = torch.rand(8)
    streams.seed_shared()
    torch.rand(8)
    without_fork = torch.rand(8)
    streams.restore()
    restored = torch.equal(torch.get_rng_state(), before)
    return {"shared": shared, "forked": forked, "forked_again": forked_again, "after": after, "without_fork": without_fork,
            "restored": restored}  # fmt: skip


@pytest.mark.parametrize("layout", ["dp_shard x tp", "dp_shard x cp"])
def test_peers_draw_alike_data_ranks_apart_and_a_fork_apart_over_its_dim(layout):
    draws = run_on_ranks(4, _draws, layout)  # ranks (0, 1) and (2, 3): peers over tp (or cp); data ranks 0 and 1
    for peers in ((0, 1), (2, 3)):
        a, b = (draws[r] for r in peers)
        assert torch.equal(a["shared"], b["shared"])  # one mask, one timestep per sample, on every peer
        assert not torch.equal(a["forked"], b["forked"])  # each peer's tokens (heads) get their own noise
    assert not torch.equal(draws[0]["shared"], draws[2]["shared"])  # other samples, other numbers
    assert not torch.equal(draws[0]["forked"], draws[2]["forked"])
    for d in draws:
        assert not torch.equal(d["forked"], d["forked_again"])  # the fork's stream goes on from call to call
        assert torch.equal(d["after"], d["without_fork"])  # and leaves the shared one where it was
        assert d["restored"]  # restore: the generator as before seed_shared


def _check(how: str) -> str:
    streams = _streams("dp_shard x cp")
    rank = dist.get_rank()
    if how == "seed + rank":  # the usual per-rank seeding: cp peers then draw other timesteps for one sample
        torch.manual_seed(7 + rank)
    else:
        streams.seed_shared()
    torch.rand(4)
    if how == "one rank draws more" and rank == 1:
        torch.rand(1)
    if how == "forked":
        with streams.fork("cp"):
            torch.randn(3 + rank)  # a draw of this rank's size: the shared stream is not touched
    try:
        streams.check_peers_agree()
    except ValueError as error:
        return str(error)
    return "agree"


def test_peers_whose_streams_differ_are_named_on_every_rank():
    assert run_on_ranks(4, _check, "shared") == ["agree"] * 4
    assert run_on_ranks(4, _check, "forked") == ["agree"] * 4
    for how, where in (("seed + rank", "data rank 0"), ("one rank draws more", "data rank 0")):
        messages = run_on_ranks(4, _check, how)
        assert len(set(messages)) == 1, messages  # the same error on every rank
        assert messages[0].startswith(f"the random streams of ranks holding the same samples differ after the step ({where}")
        assert "ranks [[0], [1]]" in messages[0], messages[0]


def _fork_over(dim: str) -> str:
    try:
        with _streams("dp_shard x tp").fork(dim):
            pass
    except ValueError as error:
        return str(error)
    return "forked"


def test_a_fork_over_a_dim_no_tensor_is_split_over_is_refused():
    message = run_on_ranks(4, _fork_over, "dp")[0]
    assert message == "fork over the mesh dims a tensor is split over, some of ('cp', 'tp'); got ('dp',)"
