#!/usr/bin/env python3
"""Loads a directory `train --save-hf OUT` wrote in transformers and prints its mean next-token
loss over the windows `train --eval-only` reads (every whole, non-overlapping window of
--seq-len + 1 tokens of a raw u16 token file), in float64 with transformers' float32 steps
replaced by float64 ones (as scripts/hf_fixtures.py's references) and as transformers ships.
With --expect L (the loss `train --from-hf OUT --eval-only --dtype f64` printed) it exits 1
unless the float64 loss is within --tolerance relative of it.

Usage: python3 scripts/hf_check_save.py OUT --data tokens.bin --seq-len 16 [--expect L]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_fixtures import eval_loss, load_f64, logits_f64, use_f64_steps, windows  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--data", required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--expect", type=float)
    ap.add_argument("--tolerance", type=float, default=1e-9)
    a = ap.parse_args()
    raw = open(a.data, "rb").read()
    tokens = [int.from_bytes(raw[i:i + 2], "little") for i in range(0, len(raw) - 1, 2)]
    w = windows(tokens, a.seq_len)
    shipped = load_f64(a.dir, None)
    as_shipped = eval_loss(shipped, w, lambda m, x: m(input_ids=x).logits)
    model = load_f64(a.dir, "sdpa")
    use_f64_steps(model)
    loss = eval_loss(model, w, logits_f64)
    print(f"{type(model).__name__} {a.dir}: eval loss {loss!r} over {w[:, 1:].numel()} tokens "
          f"(transformers as shipped: {as_shipped!r}; torch {torch.__version__})")
    if a.expect is not None:
        rel = abs(loss - a.expect) / abs(a.expect)
        print(f"against the expected {a.expect!r}: relative {rel:.3e}")
        if rel > a.tolerance:
            sys.exit(1)


if __name__ == "__main__":
    main()
