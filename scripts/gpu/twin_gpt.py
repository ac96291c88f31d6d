"""PyTorch twins of OxiFlow's GPT layouts: the same model (GPT-2 shaped as models/src/nn/gpt:
separate q, k, v linears with biases, pre-LN, GELU tanh, LayerNorm eps 1e-5, token embedding
tied to the output projection), the same data shapes (synthetic tokens, global batch split over
the ranks) and precision (bf16 autocast, f32 parameters, fused AdamW), one layout after another
in one process group:

  ddp             DistributedDataParallel
  fsdp            FSDP2 fully_shard per block and at the root, reshard after forward
  fsdp-keep       the same without resharding after forward (ZeRO-2-like)
  tp              DTensor tensor parallelism: q, k, v and fc ColwiseParallel, the projections
                  RowwiseParallel; the tied table vocabulary-sharded: the embedding
                  RowwiseParallel and the output projection ColwiseParallel share one Shard(0)
                  parameter (tied again after parallelize_module), logits stay vocabulary-split
                  into loss_parallel's cross-entropy
  tp-sp           tp plus SequenceParallel (LayerNorms and the residual stream split along the
                  sequence; the position table a Replicate DTensor sliced to each rank's rows)
  pp-1f1b         torch.distributed.pipelining Schedule1F1B, one stage per rank
  pp-interleaved  ScheduleInterleaved1F1B, --chunks stages per rank
                  Pipelines: the first stage holds the embeddings, the last ln_f and its own
                  copy of the tied table; after backward the two gradients are summed between
                  those ranks (all-reduce), so both copies stay equal (the tied table's
                  gradient coming back, as OxiFlow's runner does).

The token table is padded as OxiFlow's (`train --vocab-multiple`): --vocab real token ids
(default GPT-2's 50257), the table --vocab rounded up to --vocab-multiple rows (default 64:
nanoGPT's 50304; 1: no padding). Tokens are drawn below --vocab. Unlike OxiFlow, which keeps the
padding out of its softmax, the twin's cross-entropy runs over every padded class, as nanoGPT
and gpt2_bench.py do (the same GEMM and softmax width; only the padded classes' logits, which no
target selects, differ).

Run: python3 -m torch.distributed.run --standalone --nproc-per-node 2 twin_gpt.py
     [--layouts ddp,tp] [--models 124m,350m] [--batch 16] [--seq 1024] [--vocab 50257]
     [--vocab-multiple 64]
     (--device cpu runs on gloo with a tiny model, to check the script without GPUs.)
Rank 0 prints one `RESULT {json}` line per (model, layout), in the style of
/work/shared/anchors/gpt2_bench.py: tokens/s per GPU (global tokens per second / ranks), ms per
step, peak memory per GPU (the largest over the ranks), MFU ((6 N + 12 L d T) FLOPs per token,
N without the position table, over --peak-tflops per GPU).
"""
import argparse
import json
import math
import os
import time
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

MODELS = {"124m": (12, 12, 768), "350m": (24, 16, 1024), "tiny": (4, 4, 64)}
LAYOUTS = ["ddp", "fsdp", "fsdp-keep", "tp", "tp-sp", "pp-1f1b", "pp-interleaved"]


class Attn(nn.Module):
    def __init__(self, d, nh):
        super().__init__()
        self.hd = d // nh
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds its share of the heads.
        q, k, v = (m(x).view(B, T, -1, self.hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class Mlp(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d, nh):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=1e-5)
        self.attn = Attn(d, nh)
        self.ln_2 = nn.LayerNorm(d, eps=1e-5)
        self.mlp = Mlp(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    """The whole model, or a pipeline stage of it (`blocks` a range; `first` holds the
    embeddings, `last` ln_f and the output projection)."""

    def __init__(self, L, nh, d, V, T, blocks=None, first=True, last=True):
        super().__init__()
        self.first, self.last, self.sp = first, last, None
        if first:
            self.wte = nn.Embedding(V, d)
            self.wpe = nn.Embedding(T, d)
        self.h = nn.ModuleList([Block(d, nh) for _ in (blocks or range(L))])
        if last:
            self.ln_f = nn.LayerNorm(d, eps=1e-5)
            self.lm_head = nn.Linear(d, V, bias=False)
            if first:
                self.lm_head.weight = self.wte.weight
        for n, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * L) if n.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            else:
                nn.init.zeros_(p) if n.endswith("bias") else nn.init.ones_(p)

    def forward(self, x):
        if self.first:
            T = x.shape[1]
            if self.sp is None:
                pos = self.wpe.weight[:T]
                x = self.wte(x)
                pos = pos.to_local() if hasattr(pos, "to_local") else pos
                x = x + pos
            else:
                # Sequence parallel: the embedding comes out split along the sequence; each rank
                # adds its rows of the (Replicate) position table.
                from torch.distributed.tensor import Shard
                x = self.wte(x).to_local()
                x = x + self.wpe.weight[:T].redistribute(placements=[Shard(0)]).to_local()
        for b in self.h:
            x = b(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def table_rows(a):
    """--vocab rounded up to a multiple of --vocab-multiple (OxiFlow's padded table)."""
    return -(-a.vocab // a.vocab_multiple) * a.vocab_multiple


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def autocast_fwd_bwd(module, dev):
    """The forward and backward pass of `module` under bf16 autocast: (x, y) -> the detached loss."""
    def fwd_bwd(x, y):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = cross_entropy(module(x), y)
        loss.backward()
        return loss.detach()
    return fwd_bwd


def clip(params, max_norm, dev, across=None):
    """Clips to the global L2 norm of every gradient (DTensor or not; `across`: a group whose
    ranks hold disjoint parameters, as pipeline stages)."""
    from torch.distributed.tensor import DTensor
    grads = [p.grad for p in params if p.grad is not None]
    dt = [g for g in grads if isinstance(g, DTensor)]
    pl = [g for g in grads if not isinstance(g, DTensor)]
    sq = torch.zeros((), device=dev, dtype=torch.float32)
    if dt:
        n = torch.nn.utils.get_total_norm(dt)
        sq = sq + (n.full_tensor() if isinstance(n, DTensor) else n).float() ** 2
    if pl:
        sq = sq + torch.nn.utils.get_total_norm(pl).float() ** 2
    if across is not None:
        dist.all_reduce(sq, group=across)
    coef = torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0)
    if pl:
        torch._foreach_mul_(pl, coef)
    if dt:
        for g in dt:
            g.to_local().mul_(coef)


def build(a, layout, dims, dev, world, rank):
    """(modules to train on this rank, step function, parameters for the optimizer)."""
    L, nh, d = dims
    V, T, B = table_rows(a), a.seq, a.batch
    torch.manual_seed(1234)
    full = lambda: Gpt(L, nh, d, V, T).to(dev)
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        m = full()
        ddp = DDP(m, device_ids=[dev.index] if dev.type == "cuda" else None)
        return autocast_fwd_bwd(ddp, dev), list(m.parameters()), None, "data"
    if layout in ("fsdp", "fsdp-keep"):
        from torch.distributed.fsdp import fully_shard
        m = full()
        reshard = layout == "fsdp"
        for b in m.h:
            fully_shard(b, reshard_after_forward=reshard)
        fully_shard(m, reshard_after_forward=reshard)
        return autocast_fwd_bwd(m, dev), list(m.parameters()), None, "data"
    if layout in ("tp", "tp-sp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel import (
            ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
            loss_parallel, parallelize_module)
        mesh = init_device_mesh(dev.type, (world,))
        m = full()
        sp = layout == "tp-sp"
        seq = Shard(1) if sp else Replicate()
        plan = {
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                   use_local_output=not sp),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                       use_local_output=False),
        }
        if sp:
            plan["ln_f"] = SequenceParallel()
        parallelize_module(m, mesh, plan)
        block_plan = {
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=seq),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            block_plan.update({
                "ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),)),
            })
        for b in m.h:
            parallelize_module(b, mesh, block_plan)
        # One Shard(0) table for the lookup and the logits.
        m.lm_head.weight = m.wte.weight
        m.wpe.weight = nn.Parameter(distribute_tensor(m.wpe.weight.detach(), mesh, [Replicate()]))
        if sp:
            m.sp = True

        def fwd_bwd(x, y):
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = m(x)
            with loss_parallel():
                loss = cross_entropy(logits, y)
                loss.backward()
            return loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
        return fwd_bwd, list(m.parameters()), None, "replicated"
    if layout in ("pp-1f1b", "pp-interleaved"):
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B,
                                                  ScheduleInterleaved1F1B)
        v = a.chunks if layout == "pp-interleaved" else 1
        chunks = world * v
        if L % chunks:
            raise ValueError(f"{L} layers over {chunks} pipeline chunks")
        per = L // chunks
        mine = [rank + k * world for k in range(v)]
        mods, stages = [], []
        for c in mine:
            torch.manual_seed(1234 + c)
            mod = Gpt(L, nh, d, V, T, blocks=range(c * per, (c + 1) * per),
                      first=c == 0, last=c == chunks - 1).to(dev)
            if c == 0 or c == chunks - 1:
                # Both copies of the tied table start as the whole model's.
                torch.manual_seed(1234)
                ref = nn.Embedding(V, d)
                nn.init.normal_(ref.weight, 0.0, 0.02)
                with torch.no_grad():
                    (mod.wte if c == 0 else mod.lm_head).weight.copy_(ref.weight.to(dev))
            mods.append(mod)
            stages.append(PipelineStage(mod, c, chunks, dev))
        n_micro = a.micro_batches
        if layout == "pp-1f1b":
            sched = Schedule1F1B(stages[0], n_micro, loss_fn=cross_entropy)
        else:
            sched = ScheduleInterleaved1F1B(stages, n_micro, loss_fn=cross_entropy)
        tied = [mod.wte.weight for mod in mods if mod.first] + \
               [mod.lm_head.weight for mod in mods if mod.last]
        has_first = any(mod.first for mod in mods)
        has_last = any(mod.last for mod in mods)

        def fwd_bwd(x, y):
            losses = []
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                if has_first and has_last:
                    sched.step(x, target=y, losses=losses)
                elif has_first:
                    sched.step(x)
                elif has_last:
                    sched.step(target=y, losses=losses)
                else:
                    sched.step()
            # The tied table's gradient: first and last stage's summed (both ranks of a 2-rank
            # pipeline hold one of them).
            for w in tied:
                dist.all_reduce(w.grad)
            loss = torch.stack(losses).mean() if losses else torch.zeros((), device=dev)
            dist.all_reduce(loss)  # only the last stage's is non-zero
            return loss
        params = [p for mod in mods for p in mod.parameters()]
        return fwd_bwd, params, dist.group.WORLD, "replicated"
    raise ValueError(f"unknown layout {layout}")


def run(a, layout, name, dev, world, rank):
    dims = MODELS[name]
    L, nh, d = dims
    fwd_bwd, params, across, data = build(a, layout, dims, dev, world, rank)
    # One fused AdamW per kind of parameter: a fused step takes DTensors or plain tensors, not
    # both (tensor parallelism leaves the LayerNorms plain unless sequence-parallel).
    from torch.distributed.tensor import DTensor
    opts = []
    for kind in (True, False):
        mine = [p for p in params if isinstance(p, DTensor) == kind]
        if not mine:
            continue
        groups = [{"params": [p for p in mine if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in mine if p.dim() < 2], "weight_decay": 0.0}]
        opts.append(torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True))
    B, T = a.batch, a.seq
    if data == "data" and B % world:
        raise ValueError(f"--batch {B} does not split over {world} ranks")
    g = torch.Generator(device=dev)

    def step(i):
        g.manual_seed(i)
        tok = torch.randint(0, a.vocab, (B, T + 1), device=dev, generator=g)
        if data == "data":
            b = B // world
            tok = tok[rank * b:(rank + 1) * b]
        loss = fwd_bwd(tok[:, :-1].contiguous(), tok[:, 1:].contiguous())
        if a.clip > 0:
            clip(params, a.clip, dev, across)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_c = time.perf_counter()
    for i in range(a.warmup):
        loss = step(i)
    sync()
    dist.barrier()
    warm_s = time.perf_counter() - t_c
    t0 = time.perf_counter()
    for i in range(a.steps):
        loss = step(a.warmup + i)
    sync()
    dist.barrier()
    dt = (time.perf_counter() - t0) / a.steps
    # The whole model's parameters, the tied table once: embeddings, blocks (q, k, v, proj;
    # fc, proj; two LayerNorms), ln_f.
    n_all = (table_rows(a) + T) * d + L * (12 * d * d + 13 * d) + 2 * d
    n_mfu = n_all - T * d
    tok_gpu = B * T / dt / world
    flops_tok = 6 * n_mfu + 12 * L * d * T
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0],
                        device=dev)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {
        "tag": a.tag, "impl": "torch", "layout": layout, "model": name, "world": world,
        "n_layer": L, "n_embd": d, "params_M": round(n_all / 1e6, 2), "batch": B, "seq": T,
        "vocab": a.vocab, "table_rows": table_rows(a),
        "micro_batches": a.micro_batches if layout.startswith("pp") else 1,
        "ms_per_step": round(dt * 1e3, 2), "tokens_per_s": round(B * T / dt),
        "tokens_per_s_per_gpu": round(tok_gpu), "mfu": round(tok_gpu * flops_tok / (a.peak_tflops * 1e12), 4),
        "peak_mem_GiB": round(float(peak.item()), 2), "warmup_s": round(warm_s, 1),
        "final_loss": round(float(loss.float().item()), 4), "torch": torch.__version__,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--models", default="124m,350m")
    ap.add_argument("--batch", type=int, default=16, help="global sequences per step")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257, help="token ids (the classes)")
    ap.add_argument("--vocab-multiple", type=int, default=64,
                    help="the table's rows: --vocab rounded up to a multiple of this (1: none)")
    ap.add_argument("--micro-batches", type=int, default=4, help="pipeline micro-batches")
    ap.add_argument("--chunks", type=int, default=2, help="interleaved stages per rank")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    ap.add_argument("--clip", type=float, default=1.0, help="global-norm clipping (0: none)")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tag", default="twin")
    a = ap.parse_args()
    if a.vocab < 1 or a.vocab_multiple < 1:
        ap.error("--vocab and --vocab-multiple must be at least 1")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if a.device == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    failed = 0
    for name in a.models.split(","):
        for layout in a.layouts.split(","):
            try:
                r = run(a, layout, name, dev, world, rank)
            except Exception as e:  # one layout's failure must not hide the others
                failed += 1
                r = {"tag": a.tag, "impl": "torch", "layout": layout, "model": name,
                     "error": f"{type(e).__name__}: {e}"[:400]}
                if rank == 0:
                    traceback.print_exc()
            if rank == 0:
                print("RESULT " + json.dumps(r), flush=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    dist.destroy_process_group()
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
