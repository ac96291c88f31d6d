"""Merges gpu_boxing_bench (impls oxiflow, oxiflow-latency, nccl), nccl_bench (its raw-NCCL rows:
impl nccl on plain cudaMalloc buffers as nccl-tests uses by default, shown as "raw NCCL"; impl
nccl-registered on ncclMemAlloc buffers registered with the comm, where measured) and
dtensor_bench (dtensor) JSON files into one markdown table of busbw (GB/s). Ratios are against
raw NCCL (the library called directly from a tight loop), raw NCCL on registered buffers, and
DTensor, all measured in the same run on the same GPUs."""
import json
import os
import sys

rows = {}
for path in sys.argv[1:]:
    try:
        data = json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"<!-- skipped {path}: {e} -->")
        continue
    from_nccl_bench = os.path.basename(path).startswith("nccl_bench")
    for r in data:
        impl = r["impl"]
        if from_nccl_bench:
            if impl not in ("nccl", "nccl-registered"):
                continue
            impl = "raw" if impl == "nccl" else "rawreg"
        # S(0)->S(1) reports the local piece; key every op by the whole tensor's size.
        whole = r["bytes"] * (r["world"] if r["op"].startswith("S(0)->S(1)") else 1)
        rows.setdefault((r["world"], r["op"], whole), {})[impl] = r

cols = ["OxiFlow to_global", "Communicator call", "raw NCCL", "raw NCCL registered", "DTensor",
        "OxiFlow 1-call latency"]
print("| GPUs | boxing | tensor | " + " | ".join(c + " busbw" for c in cols)
      + " | OxiFlow/raw NCCL | OxiFlow/raw registered | OxiFlow/DTensor | OxiFlow ms |")
print("|---|---|---|" + "---|" * (len(cols) + 4))
for (world, op, whole), d in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
    ox, nc, raw, reg, dt, lat = (d.get(k) for k in
                                 ("oxiflow", "nccl", "raw", "rawreg", "dtensor", "oxiflow-latency"))
    f = lambda r: f"{r['busbw']:.1f}" if r else "-"
    ratio = lambda a, b: f"{a['busbw'] / b['busbw']:.3f}" if a and b and b["busbw"] > 0 else "-"
    size = f"{whole >> 20} MiB"
    print(f"| {world} | {op} | {size} | {f(ox)} | {f(nc)} | {f(raw)} | {f(reg)} | {f(dt)} | {f(lat)} | "
          f"{ratio(ox, raw)} | {ratio(ox, reg)} | {ratio(ox, dt)} | {ox['ms'] if ox else '-'} |")
