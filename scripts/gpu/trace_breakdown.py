#!/usr/bin/env python3
"""Where one rank's last traced training step spends its time, from an `oflaunch --trace`
timeline (DIR/trace.json; lane 4 the CUDA compute stream, lane 5 the NCCL stream, both timed
by device events). The step is the window between the ends of the last two groups of AdamW
kernels. Prints the window, the compute stream's busy time in it, the kernels by total time,
and each collective on the NCCL lane with the part of it no compute kernel ran under.

Usage: trace_breakdown.py TRACE.json [--rank R] [--top N] [--gaps N]"""
import argparse
import json
from collections import defaultdict

from trace_overlap import covered, merge

COMPUTE, NCCL = 4, 5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--gaps", type=int, default=0, help="also print the N longest idle gaps")
    a = ap.parse_args()
    ev = json.load(open(a.trace))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    mine = [e for e in ev if e.get("ph") == "X" and e.get("pid") == a.rank]
    comp = sorted((e["ts"], e["ts"] + e["dur"], e.get("name", "?")) for e in mine if e.get("tid") == COMPUTE)
    comm = sorted((e["ts"], e["ts"] + e["dur"], e.get("name", "?"), e.get("args", {})) for e in mine if e.get("tid") == NCCL)
    adam = [c for c in comp if "adamw" in c[2].lower()]
    groups = []
    for s, e, _ in adam:
        if groups and s - groups[-1][1] < 2000:
            groups[-1][1] = max(groups[-1][1], e)
        else:
            groups.append([s, e])
    if len(groups) < 2:
        raise SystemExit(f"fewer than two optimizer steps in the trace of rank {a.rank}")
    w0, w1 = groups[-2][1], groups[-1][1]
    comp = [c for c in comp if c[0] >= w0 and c[1] <= w1]
    comm = [c for c in comm if c[0] >= w0 and c[1] <= w1]
    merged = merge((s, e) for s, e, _ in comp)
    busy = sum(e - s for s, e in merged)
    print(f"rank {a.rank}: step window {(w1 - w0) / 1e3:.2f} ms, compute busy {busy / 1e3:.2f} ms, "
          f"compute idle {(w1 - w0 - busy) / 1e3:.2f} ms, {len(comp)} kernels")
    by = defaultdict(lambda: [0.0, 0])
    for s, e, n in comp:
        by[n][0] += e - s
        by[n][1] += 1
    for n, (t, k) in sorted(by.items(), key=lambda x: -x[1][0])[: a.top]:
        print(f"  {t / 1e3:7.3f} ms  {k:4d}x  {n[:70]}")
    if a.gaps:
        gaps = [(comp[i + 1][0] - comp[i][1], comp[i][2], comp[i + 1][2], comp[i][1] - w0)
                for i in range(len(comp) - 1) if comp[i + 1][0] > comp[i][1]]
        for lo, hi in ((0, 10), (10, 100), (100, 1e12)):
            sel = [g for g in gaps if lo <= g[0] < hi]
            print(f"  idle gaps {lo}-{hi if hi < 1e12 else 'inf'} us: {len(sel)}, {sum(g[0] for g in sel) / 1e3:.2f} ms")
        for g, before, after, at in sorted(gaps, reverse=True)[: a.gaps]:
            print(f"    gap {g / 1e3:6.3f} ms at {at / 1e3:6.2f} ms after {before[:40]} before {after[:40]}")
    if comm:
        tot = sum(e - s for s, e, _, _ in comm)
        exposed = sum((e - s) - covered((s, e), merged) for s, e, _, _ in comm)
        print(f"  NCCL: {len(comm)} collectives, {tot / 1e3:.2f} ms, {exposed / 1e3:.2f} ms with no compute kernel under it")
        for s, e, n, args in comm:
            x = (e - s) - covered((s, e), merged)
            if x > 20:
                print(f"    at {(s - w0) / 1e3:6.2f} ms  {(e - s) / 1e3:6.3f} ms  exposed {x / 1e3:6.3f}  {n[:40]} {json.dumps(args)[:80]}")


if __name__ == "__main__":
    main()
