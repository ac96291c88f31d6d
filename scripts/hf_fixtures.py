#!/usr/bin/env python3
"""Tiny random-weight Hugging Face models and their reference numbers, for OxiFlow's
`--from-hf` tests (tests/fixtures/hf/).

Needs torch and transformers (no network). For each model it writes, under --out:

  <name>/config.json, model.safetensors (or sharded, with model.safetensors.index.json):
      save_pretrained's own output.
  tokens.bin: the shared token file, nanoGPT's raw little-endian u16 ids.
  reference.json: per model, with the windows of --seq-len + 1 tokens of tokens.bin
      (non-overlapping, each window's first token context only):
        eval_loss: the mean next-token loss in float64 (the sum of every predicted token's loss
            over their count) of transformers' model in float64, computed in float64 through
            and through: transformers keeps three float32 steps in a float64 model (rotary
            cos/sin tables, RMSNorm's normalisation, the eager attention's softmax), each
            worth about 1e-8 of the loss; here the rotary tables and RMSNorm are replaced by
            float64 forms of the same formulas, attention runs as SDPA (float64), and the
            logits are the final hidden state times the output table, in float64;
        eval_loss_transformers: the same windows through the unmodified model (its own
            float32 steps, default attention), for the record;
        tokens: the number of predicted tokens;
        greedy: for each prompt, the ids greedy decoding appends in float64 (arg-max of each
            next-token distribution over the whole context, no cache), up to --gen-tokens,
            ending after the config's eos_token_id; greedy_generate_agrees: whether
            transformers' generate() (greedy, its cache) appended the same ids.

The models (random weights, every tensor perturbed so no norm weight is 1 and no bias 0):
  gpt2:    GPT2LMHeadModel, tied, stored f32, one file.
  llama:   LlamaForCausalLM, grouped-query (6 heads, 2 KV heads), llama3 rope scaling,
           untied, stored f32, sharded with an index.
  qwen2:   Qwen2ForCausalLM, q/k/v biases, tied, stored bf16, one file.
  mistral: MistralForCausalLM, one KV head (replicated under tensor parallelism), linear rope
           scaling, untied, stored f16, sharded with an index.
  mixtral: MixtralForCausalLM, 8 experts, top-2 (renormalised), untied, stored f32, sharded.
  qwen2_moe: Qwen2MoeForCausalLM, 6 experts, top-4 without renormalisation, a shared expert
           with its sigmoid gate, q/k/v biases, untied, stored f32, one file.
For the mixtures of experts the entry also holds aux_loss: transformers' load-balancing loss
(router_aux_loss_coef not applied) over the evaluation windows as one batch (float64 except
the fraction of tokens per expert, which transformers takes in float32: good to about 1e-7), and
saved_keys: the tensor names save_pretrained wrote.

--models NAME,... makes only those; their entries are merged into an existing reference.json
under --out (other entries kept).

Usage: python3 scripts/hf_fixtures.py --out DIR
"""

import argparse
import json
import math
import os
import traceback
import types

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

SEED = 1234
PROMPTS = [[5, 17, 3], [1, 2, 3, 4, 5, 6, 7]]


def rope_kwargs(theta, scaling):
    """Rope settings as this transformers version takes them (rope_parameters from v5)."""
    params = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        params.update(scaling)
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": params}
    legacy = {"rope_theta": theta}
    if scaling is not None:
        legacy["rope_scaling"] = dict(scaling)
    return legacy


def config(cls, extras, **kwargs):
    """`cls(**kwargs)`, then each of `extras` set where this transformers version takes it."""
    c = cls(**kwargs)
    for k, v in extras.items():
        try:
            setattr(c, k, v)
        except Exception as e:  # noqa: BLE001 - a key this version does not take is left out
            print(f"{cls.__name__}: {k} not set: {e}")
    return c


def specs():
    ids = dict(bos_token_id=0, eos_token_id=1)
    gpt2 = config(
        GPT2Config, ids, vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.2,
    )
    llama = config(
        LlamaConfig, ids, vocab_size=256, hidden_size=48, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
        initializer_range=0.2,
        **rope_kwargs(10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    )
    qwen2 = config(
        Qwen2Config, ids, vocab_size=256, hidden_size=32, intermediate_size=80,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
        use_sliding_window=False, initializer_range=0.2, **rope_kwargs(1000000.0, None),
    )
    mistral = config(
        MistralConfig, ids, vocab_size=288, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
        sliding_window=None, initializer_range=0.2,
        **rope_kwargs(10000.0, {"rope_type": "linear", "factor": 2.0}),
    )
    mixtral = config(
        MixtralConfig, ids, vocab_size=256, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
        sliding_window=None, num_local_experts=8, num_experts_per_tok=2,
        router_jitter_noise=0.0, router_aux_loss_coef=0.02, output_router_logits=False,
        initializer_range=0.2, **rope_kwargs(1000000.0, None),
    )
    qwen2_moe = config(
        Qwen2MoeConfig, ids, vocab_size=256, hidden_size=32, intermediate_size=72,
        moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=6,
        num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False, router_aux_loss_coef=0.001, output_router_logits=False,
        initializer_range=0.2, **rope_kwargs(1000000.0, None),
    )
    return [
        ("gpt2", GPT2LMHeadModel, gpt2, torch.float32, None),
        ("llama", LlamaForCausalLM, llama, torch.float32, "60KB"),
        ("qwen2", Qwen2ForCausalLM, qwen2, torch.bfloat16, None),
        ("mistral", MistralForCausalLM, mistral, torch.float16, "30KB"),
        ("mixtral", MixtralForCausalLM, mixtral, torch.float32, "40KB"),
        ("qwen2_moe", Qwen2MoeForCausalLM, qwen2_moe, torch.float32, None),
    ]


def perturb(model, seed):
    """Every parameter plus noise: norm weights not 1, biases not 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))


def rope_params(config):
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = {"rope_type": "default", "rope_theta": config.rope_theta}
    scaling = getattr(config, "rope_scaling", None)
    if scaling:
        params.update(scaling)
        params["rope_type"] = scaling.get("rope_type", scaling.get("type"))
    return params


def inv_freq_f64(config):
    """transformers' inverse frequencies (default, linear, llama3), in float64."""
    p = rope_params(config)
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv = 1.0 / (p["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    kind = p.get("rope_type", "default")
    if kind == "linear":
        inv = inv / p["factor"]
    elif kind == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = torch.where(medium, smoothed, scaled)
    elif kind != "default":
        raise ValueError(f"rope type {kind}")
    return inv


def rotary_modules(model):
    return [m for name, m in model.named_modules() if name.endswith("rotary_emb")]


def use_f64_steps(model):
    """Replaces each rotary module's forward by one computing cos/sin in float64 (after checking
    the float64 frequencies against transformers' own float32 ones) and each RMSNorm's by one
    normalising in the input's dtype."""
    for m in rotary_modules(model):
        inv = inv_freq_f64(model.config)
        theirs = m.inv_freq.to(torch.float64)
        rel = ((theirs - inv).abs() / inv).max().item()
        assert rel < 1e-6, f"float64 inverse frequencies differ from transformers' by {rel}"
        scaling = float(getattr(m, "attention_scaling", 1.0))

        def forward(self, x, position_ids, inv=inv, scaling=scaling):
            freqs = position_ids[:, :, None].to(torch.float64) * inv[None, None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)

        m.forward = types.MethodType(forward, m)
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
            assert eps is not None, f"{type(m).__name__} has no epsilon attribute"

            def norm(self, x, eps=eps):
                return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

            m.forward = types.MethodType(norm, m)
    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            # Mixtral's router takes `.float()` of its logits and Qwen2-MoE's asks softmax for
            # float32: the same formulas in the model's float64.
            renormalise = getattr(m, "norm_topk_prob", True)

            def route(self, x, renormalise=renormalise):
                x = x.reshape(-1, self.hidden_dim)
                logits = torch.nn.functional.linear(x, self.weight)
                probs = _softmax(logits, dim=-1)
                top, index = torch.topk(probs, self.top_k, dim=-1)
                if renormalise:
                    top = top / top.sum(dim=-1, keepdim=True)
                return logits, top, index

            m.forward = types.MethodType(route, m)


_softmax = torch.nn.functional.softmax


def softmax_keeping_f64(x, dim=None, _stacklevel=3, dtype=None):
    """torch's softmax, except that a float64 input stays float64 when float32 is asked for
    (the MoE routers compute their scores in float32 whatever the model's dtype)."""
    if dtype == torch.float32 and x.dtype == torch.float64:
        dtype = torch.float64
    return _softmax(x, dim=dim, dtype=dtype)


def load_f64(path, attention):
    # The experts' grouped matrix product takes no float64: the per-expert loop does.
    with open(os.path.join(path, "config.json")) as f:
        moe = "router_aux_loss_coef" in json.load(f)
    extra = {"experts_implementation": "eager"} if moe else {}
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention, **extra)
    return model.to(torch.float64).eval()


def logits_f64(model, ids):
    """The final hidden state times the output table, in float64."""
    h = model.base_model(input_ids=ids).last_hidden_state
    return model.lm_head(h).to(torch.float64)


def windows(tokens, seq_len):
    n = len(tokens) // (seq_len + 1)
    return torch.tensor(tokens[: n * (seq_len + 1)], dtype=torch.long).reshape(n, seq_len + 1)


def eval_loss(model, w, logits_of):
    with torch.no_grad():
        logits = logits_of(model, w[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"
        )
    return loss.item() / w[:, 1:].numel()


def greedy(model, prompt, n):
    """Arg-max decoding over the whole context at each step, in float64, ending after eos."""
    eos = model.config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = logits_f64(model, torch.tensor([ids], dtype=torch.long))[0, -1]
            ids.append(int(torch.argmax(logits)))
            if ids[-1] in eos:
                break
    return ids[len(prompt):]


def greedy_generate(model, prompt, n):
    eos = model.config.eos_token_id
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], dtype=torch.long), max_new_tokens=n, do_sample=False,
            num_beams=1, pad_token_id=eos, eos_token_id=eos,
        )
    return out[0, len(prompt):].tolist()


def make(name, cls, cfg, dtype, shard, out, w, gen_tokens, seed):
    """Saves one model under out/name; returns its reference entry."""
    torch.manual_seed(seed)
    model = cls(cfg)
    perturb(model, seed)
    model = model.to(dtype)
    path = os.path.join(out, name)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kwargs)
    sizes = {f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))}
    print(f"wrote {path}: {sizes}")
    shipped = load_f64(path, None)
    entry = {"architecture": type(shipped).__name__, "stored_dtype": str(dtype)}
    entry["eval_loss_transformers"] = eval_loss(shipped, w, lambda m, x: m(input_ids=x).logits)
    ref = load_f64(path, "sdpa")
    use_f64_steps(ref)
    entry["eval_loss"] = eval_loss(ref, w, logits_f64)
    entry["tokens"] = w[:, 1:].numel()
    if getattr(ref.config, "router_aux_loss_coef", None) is not None:
        from safetensors import safe_open

        keys = []
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(path, f), "pt") as st:
                    keys += list(st.keys())
        entry["saved_keys"] = sorted(keys)
        with torch.no_grad():
            out = ref(input_ids=w[:, :-1], output_router_logits=True)
        entry["aux_loss"] = float(out.aux_loss.to(torch.float64))
        entry["router_aux_loss_coef"] = ref.config.router_aux_loss_coef
    entry["greedy"] = [greedy(ref, p, gen_tokens) for p in PROMPTS]
    entry["greedy_generate_agrees"] = [
        greedy_generate(ref, p, gen_tokens) == g for p, g in zip(PROMPTS, entry["greedy"])
    ]
    return entry


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--windows", type=int, default=7)
    ap.add_argument("--gen-tokens", type=int, default=24)
    ap.add_argument("--models", default=None, help="comma-separated names (default: all)")
    a = ap.parse_args()
    torch.nn.functional.softmax = softmax_keeping_f64
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED)
    # Whole windows plus a partial one the evaluation leaves out.
    count = a.windows * (a.seq_len + 1) + 5
    tokens = torch.randint(0, 256, (count,), generator=g).tolist()
    tok_path = os.path.join(a.out, "tokens.bin")
    with open(tok_path, "wb") as f:
        for t in tokens:
            f.write(int(t).to_bytes(2, "little"))
    print(f"wrote {tok_path}: {count} tokens")
    w = windows(tokens, a.seq_len)
    reference = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seq_len": a.seq_len,
        "prompts": PROMPTS,
        "gen_tokens": a.gen_tokens,
        "models": {},
    }
    ref_path = os.path.join(a.out, "reference.json")
    wanted = a.models.split(",") if a.models else None
    if wanted and os.path.exists(ref_path):
        with open(ref_path) as f:
            reference["models"] = json.load(f)["models"]
    failed = []
    for i, (name, cls, cfg, dtype, shard) in enumerate(specs()):
        if wanted and name not in wanted:
            continue
        try:
            entry = make(name, cls, cfg, dtype, shard, a.out, w, a.gen_tokens, SEED + i)
        except Exception:  # noqa: BLE001 - the other models are still made
            traceback.print_exc()
            failed.append(name)
            continue
        reference["models"][name] = entry
        print(f"{name}: {json.dumps(entry)}")
    with open(ref_path, "w") as f:
        json.dump(reference, f, indent=1)
    print(f"wrote {ref_path}")
    if failed:
        raise SystemExit(f"failed: {failed}")


if __name__ == "__main__":
    main()
