"""torch DTensor `redistribute` of the same f32 tensors nccl_bench moves, busbw by nccl-tests rules.

Run: python3 -m torch.distributed.run --standalone --nproc-per-node N dtensor_bench.py --out f.json
Prints and writes the same JSON schema as nccl_bench (impl "dtensor").
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def done(t):
    loc = t.to_local()
    if hasattr(loc, "wait"):
        loc = loc.wait()
    return loc


def timeit(fn, iters, trials=3):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(trials):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / iters)
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", default="1,4,16,64,256,1024")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (world,))
    pf = (world - 1) / world
    results = []

    def out(op, nbytes, ms, factor):
        r = {"world": world, "op": op, "impl": "dtensor", "bytes": nbytes, "ms": round(ms, 5),
             "busbw": round(nbytes / (ms * 1e-3) / 1e9 * factor, 2)}
        results.append(r)
        if rank == 0:
            print("RESULT " + json.dumps(r), flush=True)

    for mib in [int(s) for s in args.sizes_mib.split(",")]:
        nbytes = mib << 20
        n = nbytes // 4
        cols = 1024
        rows = n // cols
        iters = max(10, min(200, (4 << 30) // nbytes))
        g = torch.Generator(device="cuda").manual_seed(rank)
        local = torch.rand(rows // world, cols, device="cuda", generator=g)
        s0 = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        t = timeit(lambda: done(s0.redistribute(mesh, [Replicate()])), iters)
        out("S->B all-gather", nbytes, t, pf)
        full = torch.rand(rows, cols, device="cuda", generator=g)
        p = DTensor.from_local(full, mesh, [Partial()], run_check=False)
        t = timeit(lambda: done(p.redistribute(mesh, [Replicate()])), iters)
        out("P->B all-reduce", nbytes, t, 2 * pf)
        t = timeit(lambda: done(p.redistribute(mesh, [Shard(0)])), iters)
        out("P->S reduce-scatter", nbytes, t, pf)
        del full, p
        t = timeit(lambda: done(s0.redistribute(mesh, [Shard(1)])), iters)
        out("S(0)->S(1) all-to-all", nbytes // world, t, pf)
        del local, s0
        torch.cuda.empty_cache()
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
