# Sourced by the device scripts: `sampled LOG COMMAND...` runs COMMAND (output to LOG) while
# nvidia-smi samples GPU 0's used memory every 100 ms (what an out-of-memory error sees, one
# process running), then appends "SMI_PEAK_MIB n" to LOG and names a failure with its last
# error lines.
sampled() {
  local log=$1; shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 100 > "$log.smi" &
  local smi=$!
  "$@" > "$log" 2>&1
  local code=$?
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  echo "SMI_PEAK_MIB $(sort -n "$log.smi" | tail -1)" >> "$log"
  [ "$code" = 0 ] || echo "$log failed ($code): $(grep -iE "error|memory" "$log" | tail -2 | cut -c1-200)"
}
