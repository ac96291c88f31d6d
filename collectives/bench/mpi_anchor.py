"""Anchor for collectives_bench: the same collectives and sizes with mpi4py (Open MPI) or,
with --gloo, torch.distributed's gloo backend. Prints `RESULT <op> <bytes> <median seconds>`
on rank 0, sizes as defined by nccl-tests (see collectives_bench)."""
import argparse
import os
import statistics
import time

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--sizes", required=True, help="comma-separated byte sizes")
p.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,all_to_all")
p.add_argument("--gloo", action="store_true")
a = p.parse_args()
sizes = [int(s) for s in a.sizes.split(",")]


def repeats(size):
    return max(3, min(20, (64 << 20) // max(size, 1)))


if a.gloo:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()

    def run(op, size):
        e = size // 4
        if op == "all_reduce":
            x = torch.ones(e)
            return lambda: dist.all_reduce(x)
        if op == "all_gather":
            x = torch.ones(e // n)
            out = torch.empty(e // n * n)
            return lambda: dist.all_gather_into_tensor(out, x)
        if op == "reduce_scatter":
            x = torch.ones(e // n * n)
            out = torch.empty(e // n)
            return lambda: dist.reduce_scatter_tensor(out, x)
        x = torch.ones(e // n * n)
        out = torch.empty(e // n * n)
        return lambda: dist.all_to_all_single(out, x)

    barrier = dist.barrier
else:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()

    def run(op, size):
        e = size // 4
        if op == "all_reduce":
            x = np.ones(e, np.float32)
            out = np.empty_like(x)
            return lambda: comm.Allreduce(x, out)
        if op == "all_gather":
            x = np.ones(e // n, np.float32)
            out = np.empty(e // n * n, np.float32)
            return lambda: comm.Allgather(x, out)
        if op == "reduce_scatter":
            x = np.ones(e // n * n, np.float32)
            out = np.empty(e // n, np.float32)
            return lambda: comm.Reduce_scatter_block(x, out)
        x = np.ones(e // n * n, np.float32)
        out = np.empty_like(x)
        return lambda: comm.Alltoall(x, out)

    barrier = comm.Barrier

for op in a.ops.split(","):
    for size in sizes:
        f = run(op, size)
        f()
        times = []
        for _ in range(repeats(size)):
            barrier()
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        if rank == 0:
            print(f"RESULT {op} {size} {statistics.median(times)}", flush=True)
