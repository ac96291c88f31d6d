#!/usr/bin/env python3
"""How much of one rank's NCCL time ran under its compute kernels, from an `oflaunch --trace`
timeline (DIR/trace.json: Chrome-trace complete events; pid = rank, tid = lane; lane 4 the
CUDA compute stream, lane 5 the NCCL stream, both timed by device events).

Usage: trace_overlap.py TRACE.json [--rank R] [--op all_reduce]
Prints the collectives on the NCCL lane (count, total ms), the part of that time during which
the compute stream ran a kernel, and the line
  all-reduce time overlapped with backward kernels: X%
counted over the last step's collectives: those after the largest gap between two consecutive
ones (the optimizer and the next forward pass separate one step's reductions from the next)."""
import argparse
import json

COMPUTE, NCCL = 4, 5


def merge(spans):
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def covered(span, merged):
    s, e = span
    return sum(max(0, min(e, b) - max(s, a)) for a, b in merged if a < e and b > s)


def last_step(comm):
    """The collectives of the last step: those after the largest gap between collectives."""
    if len(comm) < 2:
        return comm
    gaps = [(comm[i + 1][0] - comm[i][1], i + 1) for i in range(len(comm) - 1)]
    _, cut = max(gaps)
    return comm[cut:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--op", default="all_reduce")
    a = ap.parse_args()
    events = json.load(open(a.trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    mine = [e for e in events if e.get("ph") == "X" and e.get("pid") == a.rank]
    compute = merge((e["ts"], e["ts"] + e["dur"]) for e in mine if e.get("tid") == COMPUTE)
    comm = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in mine
        if e.get("tid") == NCCL and a.op in e.get("name", "")
    )
    if not comm:
        raise SystemExit(f"no {a.op} on the NCCL lane of rank {a.rank} in {a.trace}")
    step = last_step(comm)
    total = sum(e - s for s, e in step)
    under = sum(covered(c, compute) for c in step)
    pct = 100.0 * under / total if total > 0 else 0.0
    print(f"rank {a.rank}: {len(comm)} {a.op} on the NCCL lane in the trace, {len(step)} in the last step "
          f"({total / 1e3:.2f} ms), {under / 1e3:.2f} ms of it under compute kernels")
    what = "all-reduce" if a.op == "all_reduce" else a.op
    print(f"{what} time overlapped with {'backward' if a.op == 'all_reduce' else 'compute'} kernels: {pct:.1f}%")


if __name__ == "__main__":
    main()
