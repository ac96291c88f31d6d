"""What the transformers training twins (llama_cp_bench.py, mixtral_bench.py) share: torch's
AdamW as the anchors run it (weight decay 0.1 on matrices, none on vectors, fused), the update
that ends each step (clipping at 1.0), and the timed loop (warm-up steps, then timed steps, peak
memory counted from after the warm-up).
"""
import time

import torch


def adamw_with_decay_groups(m):
    """Fused AdamW over `m`'s parameters (lr 3e-4, betas 0.9/0.95, eps 1e-8), weight decay 0.1
    on the parameters of two or more dims and none on the others."""
    decay = [p for p in m.parameters() if p.dim() >= 2]
    no_decay = [p for p in m.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)


def timed_steps(step, warmup, steps, t0):
    """Runs `step` `warmup` times, resets the peak memory count, then runs it `steps` times.
    Returns the last step's loss, the seconds from `t0` to the end of the warm-up, and the mean
    seconds per timed step."""
    for _ in range(warmup):
        loss = step()
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    t1 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    return loss, warm, (time.perf_counter() - t1) / steps


def clip_and_step(m, opt):
    """Clips `m`'s gradients to a global norm of 1.0, steps `opt` and clears the gradients."""
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
