"""PyTorch twin of `gpt_bench --arch llama --cp N` on N GPUs (torchrun): transformers'
LlamaForCausalLM at the Llama-3.2-1B shape (as ../shared/anchors/llama_bench.py: SDPA attention,
f32 parameters with bf16 autocast, fused AdamW, clipping at 1.0) with context parallelism
torchtitan's way: `torch.distributed.tensor.experimental.context_parallel` shards the sequence
dim of the input ids, labels and position ids over a `cp` mesh of every rank (load-balanced
causal chunks) and runs SDPA as ring attention (`--rotate alltoall`: K/V passed rank to rank;
`allgather`: gathered once), gradients averaged by DDP over the ranks. Every rank draws the same
tokens. Prints RESULT {json} on rank 0 with ms per step, tokens/s and MFU per GPU (6N + 12 L d T
FLOPs per token, a tied table once) and peak memory (torch's count and the process's by NVML).

  torchrun --nproc-per-node 2 llama_cp_bench.py --seq 16384 [--compile] [--rotate alltoall]
"""
import argparse, json, os, time
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as tf
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_train_bench import adamw_with_decay_groups, clip_and_step, timed_steps


def process_mib(index):
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        return round(pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20)
    except Exception:
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--rotate", default="alltoall", choices=["alltoall", "allgather"])
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    set_rotate_method(a.rotate)
    torch.manual_seed(1234)
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = tf.LlamaConfig(vocab_size=a.vocab, hidden_size=a.width, intermediate_size=a.ffn,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads,
                         num_key_value_heads=a.kv_heads, max_position_embeddings=a.seq,
                         rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
    cfg._attn_implementation = "sdpa"
    t0 = time.perf_counter()
    m = tf.LlamaForCausalLM(cfg).to(dev)
    n_all = sum(p.numel() for p in m.parameters())
    opt = adamw_with_decay_groups(m)
    ddp = DDP(m, device_ids=[local]) if world > 1 else m
    fwd = torch.compile(ddp) if a.compile else ddp
    g = torch.Generator(device=dev).manual_seed(0)
    B, T = a.micro_batch, a.seq

    def step():
        tok = torch.randint(0, a.vocab, (B, T + 1), device=dev, generator=g)
        inp, lab = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
        pos = torch.arange(T, device=dev).unsqueeze(0).expand(B, T).contiguous()
        with context_parallel(mesh, buffers=[inp, lab, pos], buffer_seq_dims=[1, 1, 1],
                              no_restore_buffers={inp, lab, pos}):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = fwd(input_ids=inp, position_ids=pos).logits
                loss = F.cross_entropy(logits.flatten(0, 1).float(), lab.flatten())
            loss.backward()
        clip_and_step(m, opt)
        return loss

    loss, warm, dt = timed_steps(step, a.warmup, a.steps, t0)
    tok_s = B * T / dt / world
    flops_tok = 6 * n_all + 12 * a.layers * a.width * a.seq
    r = {"tag": a.tag, "mode": "train", "compile": a.compile, "cp": world, "rotate": a.rotate,
         "params_M": round(n_all / 1e6, 1), "micro_batch": B, "seq": T, "ms_per_step": round(dt * 1e3, 2),
         "tokens_per_s": round(tok_s), "mfu": round(tok_s * flops_tok / (a.peak_tflops * 1e12), 4),
         "warmup_s": round(warm, 1), "final_loss": round(loss.item(), 4),
         "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
         "process_MiB": process_mib(local), "torch": torch.__version__}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(r), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
