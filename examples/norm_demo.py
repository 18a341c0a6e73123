"""Exact global gradient norm of an FSDP2 x tensor-parallel model on CPU ranks, against one device.

Runs 4 gloo processes (dp_shard=2 x tp=2). Tensor parallelism covers the first two layers only, so
the parameters live on two different meshes: ``torch.nn.utils.clip_grad_norm_`` refuses that model,
``lightning_ndclip.clip_grad_norm_`` clips it exactly with one all-reduce.

    python examples/norm_demo.py            # or: --dp-shard 2 --tp 2 --max-norm 0.25
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import lightning_ndclip as nd


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 7)).double()


def parallelize(model: nn.Sequential, mesh: DeviceMesh) -> nn.Sequential:
    """Tensor parallel on the first two layers only (when the ``tp`` dim is > 1), FSDP2 over ``dp_shard``."""
    if mesh["tp"].size() > 1:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    # the TP linears stay in the root unit: their outputs are views (DTensor.to_local), and FSDP2 warns
    # when a unit returns a view (an in-place op on it would skip the unit's backward hooks)
    fully_shard(model[4], mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    return model


def batches(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4 * dp, 32, generator=g, dtype=torch.float64)
    y = torch.randn(4 * dp, 7, generator=g, dtype=torch.float64)
    return list(zip(x.chunk(dp), y.chunk(dp)))


def single_device_norm(dp: int) -> float:
    model = build_model()
    loss = sum(nn.functional.mse_loss(model(x), y) for x, y in batches(dp)) / dp
    loss.backward()
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


def worker(rank: int, world: int, dp: int, tp: int, max_norm: float, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    demo(dp, tp, max_norm)
    dist.destroy_process_group()


def demo(dp: int, tp: int, max_norm: float) -> None:
    """On every rank of the process group (``dp x tp`` ranks): the model parallelized, one backward, torch's clip
    tried, the exact norm and the clip; rank 0 prints them against one device."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
    model = parallelize(build_model(), mesh)
    x, y = batches(dp)[mesh["dp_shard"].get_local_rank()]
    nn.functional.mse_loss(model(x), y).backward()

    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        torch_says = "ok"
    except Exception as e:  # noqa: BLE001 - showing what torch does on this model
        torch_says = f"{type(e).__name__}: {str(e).splitlines()[0][:70]}"
    nd.grad_norms(model)  # the first call with a layout agrees on a plan (one small exchange)
    with CommDebugMode() as comm:  # the logging + clipping path of a training step
        norms = nd.grad_norms(model)
        nd.clip_grads_with_norm_(model.parameters(), max_norm, norms.total)
    total = norms.total
    after = nd.get_total_norm([p.grad for p in model.parameters()])
    if rank == 0:
        reference = single_device_norm(dp)
        print(f"mesh dp_shard={dp} x tp={tp} on {world} CPU ranks (gloo)")
        print(f"torch.nn.utils.clip_grad_norm_      : {torch_says}")
        print(f"single-device float64 norm          : {reference:.15f}")
        print(f"lightning_ndclip global norm        : {float(total):.15f}")
        print(f"relative error                      : {abs(float(total) - reference) / reference:.2e}")
        print(f"norm after clipping to {max_norm:<12} : {float(after):.15f}")
        print(f"collectives for norms + clip        : {comm.get_total_counts()}")
        print("per-parameter global norms (same all-reduce):")
        for name, value in norms.as_dict().items():
            print(f"  {name:<12} {float(value):.10f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp-shard", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--max-norm", type=float, default=0.25)
    parser.add_argument("--port", type=int, default=0, help="rendezvous port (default: a free one)")
    args = parser.parse_args()
    world = args.dp_shard * args.tp
    port = args.port or free_port()
    mp.spawn(worker, args=(world, args.dp_shard, args.tp, args.max_norm, port), nprocs=world)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
