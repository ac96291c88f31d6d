"""Reads the device scripts' logs: the `RESULT {json}` lines the benchmarks print and the
`SMI_PEAK_MIB n` line sampled.sh appends (median_table.py, and the tables of
gpt_bench_there.sh, gpt_sizes_there.sh and cp_ep_there.sh).
"""
import glob, json

MARK = "RESULT {"


def result_of(line):
    """The json of a `RESULT {json}` line, None for any other line."""
    return json.loads(line[line.index(MARK) + 7:]) if MARK in line else None


def results(folder):
    """Every RESULT json of folder/*.log, the logs in name order, each log's in its order."""
    rows = []
    for f in sorted(glob.glob(folder + "/*.log")):
        for line in open(f, errors="replace"):
            r = result_of(line)
            if r is not None:
                rows.append(r)
    return rows


def last_result_and_peak(path):
    """The last RESULT json of the log at `path` and its `SMI_PEAK_MIB` value in MiB (each None
    where the log has none)."""
    r, smi = None, None
    for line in open(path, errors="replace"):
        if MARK in line:
            r = result_of(line)
        if line.startswith("SMI_PEAK_MIB ") and len(line.split()) > 1:
            smi = float(line.split()[1])
    return r, smi


def rank0_rounds(folder):
    """The first rank-0 RESULT json of each folder/TAG@ROUND.log, grouped by TAG (rounds in
    name order): what overlap_there.sh and dp2_probe_there.sh take medians over."""
    runs = {}
    for path in sorted(glob.glob(folder + "/*@*.log")):
        tag = path.rsplit("/", 1)[-1][:-4].split("@")[0]
        for line in open(path, errors="replace"):
            if MARK in line and ("[rank 0]" in line or "[rank" not in line):
                runs.setdefault(tag, []).append(result_of(line))
                break
    return runs
