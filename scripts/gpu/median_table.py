"""Prints the table of a device script's runs: every `RESULT {json}` line of OUT/*.log grouped
by its tag (medians over rounds), each log's `SMI_PEAK_MIB n` (sampled.sh) as the process peak,
and each tag's speed and process memory against the reference tag.

  python3 median_table.py OUT REFERENCE_TAG TAG...
"""
import glob, statistics, sys

from result_logs import last_result_and_peak

out, ref, tags = sys.argv[1], sys.argv[2], sys.argv[3:]
runs = {}
for f in sorted(glob.glob(out + "/*.log")):
    r, smi = last_result_and_peak(f)
    if r:
        r["smi_GiB"] = smi / 1024 if smi else float("nan")
        runs.setdefault(r["tag"], []).append(r)


def med(tag, k):
    v = [x.get(k) for x in runs.get(tag, []) if isinstance(x.get(k), (int, float))]
    return statistics.median(v) if v else float("nan")


print(f"| run | ms/step | tokens/s | MFU | own peak GiB | process peak GiB (nvidia-smi) | vs {ref} | mem vs {ref} |")
print("|---|---|---|---|---|---|---|---|")
for tag in tags:
    if tag not in runs:
        print(f"| {tag} | failed |||||||")
        continue
    tok, smi = med(tag, "tokens_per_s"), med(tag, "smi_GiB")
    print(f"| {tag} | {med(tag, 'ms_per_step'):.2f} | {tok:,.0f} | {100 * med(tag, 'mfu'):.1f}% | "
          f"{med(tag, 'peak_mem_GiB'):.2f} | {smi:.2f} | {tok / med(ref, 'tokens_per_s'):.3f} | "
          f"{smi / med(ref, 'smi_GiB'):.2f} |")
