#!/usr/bin/env bash
# Builds a test target in release mode and prints the path of its executable (for staging it
# onto a GPU machine without Rust). Usage: scripts/gpu/test_executable.sh <package> <test>
set -euo pipefail
cd "$(dirname "$0")/../.."
exe=$(cargo test --release -p "$1" --test "$2" --no-run --message-format=json 2>/dev/null |
  python3 -c 'import sys, json
name = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == name:
        print(m["executable"])' "$2")
[ -n "$exe" ] || { echo "test_executable: no executable for $1 --test $2" >&2; exit 1; }
echo "$exe"
