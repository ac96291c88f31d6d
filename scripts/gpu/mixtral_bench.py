"""PyTorch twin of `gpt_bench --arch llama --experts E --top-k K`: transformers'
MixtralForCausalLM (softmax router, top-k renormalised, SwiGLU experts, no load-balancing loss
in the loss: `output_router_logits` off), random tokens, f32 parameters with bf16 autocast, SDPA
attention, fused AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1 on matrices), clipping at
1.0; `--compile` wraps the model in torch.compile. Prints RESULT {json} as llama_bench.py does,
its MFU over the parameters a token meets (the top-k experts of each block, a tied table once).
Under torchrun with several ranks: DistributedDataParallel (every expert on every GPU, 25 MiB
gradient buckets), each GPU its own `--micro-batch` sequences; tokens/s and memory per GPU
(rank 0's), the twin of `gpt_bench --dp N [--ep E]`.

  python3 mixtral_bench.py [--compile] [--experts 8 --top-k 2 --ffn 3584 --layers 16]
  torchrun --standalone --nproc-per-node 2 mixtral_bench.py [--compile]
"""
import argparse, json, os, time
import torch
import transformers as tf

from hf_train_bench import adamw_with_decay_groups, clip_and_step, timed_steps
from llama_bench import process_mib


def main():
    ap = argparse.ArgumentParser()
    for name, default in [("layers", 16), ("width", 1024), ("heads", 16), ("kv-heads", 8), ("ffn", 3584),
                          ("vocab", 32000), ("experts", 8), ("top-k", 2), ("seq", 2048), ("micro-batch", 4),
                          ("warmup", 4), ("steps", 10)]:
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    if world > 1:
        torch.distributed.init_process_group("nccl", device_id=dev)
    torch.manual_seed(1234)
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = tf.MixtralConfig(vocab_size=a.vocab, hidden_size=a.width, intermediate_size=a.ffn,
                           num_hidden_layers=a.layers, num_attention_heads=a.heads,
                           num_key_value_heads=a.kv_heads, num_local_experts=a.experts,
                           num_experts_per_tok=a.top_k, max_position_embeddings=a.seq,
                           rope_theta=500000.0, tie_word_embeddings=a.tie, rms_norm_eps=1e-5,
                           output_router_logits=False, sliding_window=None)
    cfg._attn_implementation = "sdpa"
    t0 = time.perf_counter()
    m = tf.MixtralForCausalLM(cfg).to(dev)
    n_all = sum(p.numel() for p in m.parameters())
    n_mfu = n_all - a.layers * (a.experts - a.top_k) * 3 * a.width * a.ffn
    opt = adamw_with_decay_groups(m)
    model = torch.nn.parallel.DistributedDataParallel(m, device_ids=[local]) if world > 1 else m
    fwd = torch.compile(model) if a.compile else model
    g = torch.Generator(device=dev).manual_seed(rank)
    B, T = a.micro_batch, a.seq

    def step():
        tok = torch.randint(0, a.vocab, (B, T + 1), device=dev, generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(input_ids=tok[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tok[:, 1:].flatten())
        loss.backward()
        clip_and_step(m, opt)
        return loss

    loss, warm, dt = timed_steps(step, a.warmup, a.steps, t0)
    tok_s = B * T / dt
    flops_tok = 6 * n_mfu + 12 * a.layers * a.width * a.seq
    r = {"tag": a.tag, "mode": "train", "compile": a.compile, "world": world, "params_M": round(n_all / 1e6, 1),
         "active_params_M": round(n_mfu / 1e6, 1), "micro_batch": B, "seq": T,
         "ms_per_step": round(dt * 1e3, 2), "tokens_per_s": round(tok_s),
         "mfu": round(tok_s * flops_tok / (a.peak_tflops * 1e12), 4), "warmup_s": round(warm, 1),
         "final_loss": round(loss.item(), 4), "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
         "process_MiB": process_mib(), "transformers": tf.__version__, "torch": torch.__version__}
    if rank == 0:  # local rank 0: the first visible GPU, the one process_mib reads
        print("RESULT " + json.dumps(r), flush=True)
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
