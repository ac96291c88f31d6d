"""Merges gpu_boxing_bench (impls oxiflow, oxiflow-latency, nccl) and dtensor_bench (dtensor)
JSON files into one markdown table (busbw GB/s); nccl_bench's files merge the same way."""
import json
import sys

rows = {}
for path in sys.argv[1:]:
    try:
        data = json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"<!-- skipped {path}: {e} -->")
        continue
    for r in data:
        # S(0)->S(1) reports the local piece; key every op by the whole tensor's size.
        whole = r["bytes"] * (r["world"] if r["op"].startswith("S(0)->S(1)") else 1)
        rows.setdefault((r["world"], r["op"], whole), {})[r["impl"]] = r

print("| GPUs | boxing | tensor | OxiFlow busbw | bare NCCL busbw | DTensor busbw | OxiFlow latency busbw | OxiFlow/NCCL | OxiFlow/DTensor | OxiFlow ms |")
print("|---|---|---|---|---|---|---|---|---|---|")
for (world, op, whole), d in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
    ox, nc, dt, lat = d.get("oxiflow"), d.get("nccl"), d.get("dtensor"), d.get("oxiflow-latency")
    f = lambda r: f"{r['busbw']:.1f}" if r else "-"
    ratio = lambda a, b: f"{a['busbw'] / b['busbw']:.3f}" if a and b and b["busbw"] > 0 else "-"
    size = f"{whole >> 20} MiB"
    print(f"| {world} | {op} | {size} | {f(ox)} | {f(nc)} | {f(dt)} | {f(lat)} | {ratio(ox, nc)} | {ratio(ox, dt)} | {ox['ms'] if ox else '-'} |")
