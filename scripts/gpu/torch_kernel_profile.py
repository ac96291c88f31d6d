#!/usr/bin/env python3
"""Where a PyTorch GPT-2 step spends its GPU time: the anchor's model (gpt2_bench.py, same
folder), eager or torch.compile, warmed up, then `--steps` steps under torch.profiler. Prints
the step's wall time, the GPU's busy time (kernels and copies, merged), and the kernels by total
time per step, grouped by name.

Usage: torch_kernel_profile.py [--compile] [--micro-batch 8] [--top 25]"""
import argparse
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

import gpt2_bench as gb


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.manual_seed(1234)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = gb.GPT(12, 12, 768, 50304, 1024).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    fwd = torch.compile(model) if a.compile else model
    B, T = a.micro_batch, 1024

    def step():
        tok = torch.randint(0, 50257, (B, T + 1), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(tok[:, :-1], tok[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(6):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 10 * 1e3
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    iv = sorted((e.time_range.start, e.time_range.end) for e in ev)
    busy, cur = 0.0, None
    for s, e in iv:
        if cur and s <= cur[1]:
            cur[1] = max(cur[1], e)
        else:
            if cur:
                busy += cur[1] - cur[0]
            cur = [s, e]
    if cur:
        busy += cur[1] - cur[0]
    by = defaultdict(lambda: [0.0, 0])
    for e in ev:
        by[e.name][0] += e.time_range.end - e.time_range.start
        by[e.name][1] += 1
    tag = "torch.compile" if a.compile else "torch eager"
    print(f"{tag} mb{B}: wall {wall:.2f} ms/step, GPU busy {busy / a.steps / 1e3:.2f} ms/step, "
          f"{len(ev) / a.steps:.0f} kernels/step")
    for n, (t, k) in sorted(by.items(), key=lambda x: -x[1][0])[: a.top]:
        print(f"  {t / a.steps / 1e3:7.3f} ms  {k / a.steps:5.0f}x  {n[:90]}")


if __name__ == "__main__":
    main()
