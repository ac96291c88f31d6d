#!/usr/bin/env python3
"""Reads the timelines cupti_timeline.c wrote for a run (one file a process, every kernel, copy and
memset with its device, stream, start and end) and says where each device's step time goes.

Steps are cut at the optimizer: a cluster of kernels whose name matches STEP (the AdamW update)
ends a step. For each device, over the steps after the first SKIP, medians of: the step; the time
the device ran compute (kernels other than NCCL's, copies, memsets; the union over streams); the
time NCCL kernels ran; the part of NCCL's time no compute ran beside (exposed); the time nothing
ran (idle: launch gaps and waits). Then, for the median step, each NCCL kernel (offset from the
step's start, length, share under compute), the largest idle gaps with the kernels around them,
and, with --against DIR (another run's timelines), the kernels whose summed time per step grew
most over that run (contention shows there).

usage: timeline_report.py DIR [--against DIR] [--step REGEX] [--skip N] [--top N]
"""
import argparse
import collections
import glob
import os
import re
import statistics

from trace_overlap import covered, merge


def load(folder):
    """{device: [(start, end, kind, name, stream)]} over every timeline file in the folder."""
    per_dev = collections.defaultdict(list)
    dropped = 0
    for path in glob.glob(os.path.join(folder, "timeline-*.txt")):
        with open(path) as f:
            for line in f:
                parts = line.rstrip("\n").split(" ", 5)
                if parts[0] == "D":
                    dropped += int(parts[1])
                    continue
                if parts[0] not in "KCS" or len(parts) < 6:
                    continue
                dev, stream, start, end = (int(p) for p in parts[1:5])
                name = parts[5] if parts[0] == "K" else ("copy " if parts[0] == "C" else "") + parts[5]
                per_dev[dev].append((start, end, parts[0], name, stream))
    for recs in per_dev.values():
        recs.sort()
    return per_dev, dropped


def length(merged):
    return sum(e - s for s, e in merged)


def is_nccl(name):
    return "ncclDevKernel" in name or name.startswith("nccl")


def steps(recs, step_re, gap_ns=2_000_000):
    """Step windows (start, end): between the ends of successive clusters of STEP kernels."""
    ends = []
    last_start = None
    for s, e, kind, name, _ in recs:
        if kind == "K" and step_re.search(name):
            if last_start is not None and s - last_start < gap_ns:
                ends[-1] = max(ends[-1], e)
            else:
                ends.append(e)
            last_start = s
    return list(zip(ends, ends[1:]))


def step_stats(recs, window):
    lo, hi = window
    inside = [r for r in recs if r[1] > lo and r[0] < hi]
    clip = [(max(s, lo), min(e, hi), k, n, st) for s, e, k, n, st in inside]
    nccl = merge([(s, e) for s, e, _, n, _ in clip if is_nccl(n)])
    comp = merge([(s, e) for s, e, _, n, _ in clip if not is_nccl(n)])
    both = sum(covered(span, comp) for span in nccl)
    busy = length(comp) + length(nccl) - both
    return {
        "step": hi - lo,
        "compute": length(comp),
        "nccl": length(nccl),
        "exposed": length(nccl) - both,
        "idle": (hi - lo) - busy,
        "records": clip,
        "comp_union": comp,
    }


def per_name(records):
    acc = collections.Counter()
    for s, e, _, n, _ in records:
        acc[short(n)] += e - s
    return acc


def short(name):
    return re.sub(r"\s+", " ", name)[:70]


def report(folder, step_re, skip, against, top=0):
    per_dev, dropped = load(folder)
    if dropped:
        print(f"  ({dropped} records dropped by CUPTI)")
    base = None
    if against:
        base_dev, _ = load(against)
        base = {}
        for dev, recs in base_dev.items():
            ws = steps(recs, step_re)[skip:]
            sums = collections.Counter()
            for w in ws:
                sums.update(per_name(step_stats(recs, w)["records"]))
            base[dev] = {k: v / max(len(ws), 1) for k, v in sums.items()}
    for dev in sorted(per_dev):
        recs = per_dev[dev]
        ws = steps(recs, step_re)[skip:]
        if not ws:
            print(f"device {dev}: no steps found (STEP {step_re.pattern!r})")
            continue
        stats = [step_stats(recs, w) for w in ws]
        med = {k: statistics.median(s[k] for s in stats) / 1e6 for k in ("step", "compute", "nccl", "exposed", "idle")}
        print(f"device {dev}: {len(ws)} steps  step {med['step']:.2f} ms  compute {med['compute']:.2f}  "
              f"nccl {med['nccl']:.2f}  nccl exposed {med['exposed']:.2f}  idle {med['idle']:.2f}")
        mid = sorted(stats, key=lambda s: s["step"])[len(stats) // 2]
        lo = min(r[0] for r in mid["records"])
        for s, e, _, n, _ in mid["records"]:
            if is_nccl(n):
                under = covered((s, e), mid["comp_union"])
                print(f"    nccl at {(s - lo) / 1e6:7.3f} ms for {(e - s) / 1e6:6.3f} ms, "
                      f"{under / max(e - s, 1):4.0%} under compute: {short(n)[:40]}")
        gaps = []
        busy = merge([(s, e) for s, e, *_ in mid["records"]])
        for (s0, e0), (s1, e1) in zip(busy, busy[1:]):
            gaps.append((s1 - e0, e0, s1))
        gaps.sort(reverse=True)
        names_at = mid["records"]
        for g, e0, s1 in gaps[:6]:
            before = max((r for r in names_at if r[1] <= e0), key=lambda r: r[1], default=None)
            after = min((r for r in names_at if r[0] >= s1), key=lambda r: r[0], default=None)
            print(f"    idle {g / 1e6:6.3f} ms at {(e0 - lo) / 1e6:7.3f}: after {short(before[3])[:34] if before else '-'}"
                  f" | before {short(after[3])[:34] if after else '-'}")
        if top:
            sums = collections.Counter()
            counts = collections.Counter()
            for s in stats:
                sums.update(per_name(s["records"]))
                counts.update(short(r[3]) for r in s["records"])
            for k, v in sums.most_common(top):
                print(f"    {v / len(stats) / 1e3:8.1f} us/step in {counts[k] // len(stats):4d} runs: {k}")
        ref = base.get(dev, next(iter(base.values()), None)) if base else None
        if ref is not None:
            sums = collections.Counter()
            for s in stats:
                sums.update(per_name(s["records"]))
            grew = sorted(((v / len(stats) - ref.get(k, 0), k) for k, v in sums.items()), reverse=True)
            for d, k in grew[:8] + grew[-4:]:
                print(f"    {d / 1e6:+7.3f} ms/step over the other run: {k}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--against")
    ap.add_argument("--step", default="adamw")
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--top", type=int, default=0, help="also the N kernels of most time per step")
    a = ap.parse_args()
    report(a.folder, re.compile(a.step, re.I), a.skip, a.against, a.top)


if __name__ == "__main__":
    main()
