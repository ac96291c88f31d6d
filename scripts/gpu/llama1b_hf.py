"""Saves a Llama-3.2-1B-shaped LlamaForCausalLM with random weights (seed 1234, bf16) where the
generation scripts read it: `python3 llama1b_hf.py DIR`."""
import sys

import torch
import transformers as tf

torch.manual_seed(1234)
cfg = tf.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=2048, rope_theta=500000.0, tie_word_embeddings=True,
                     rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=128255)
tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
print("saved", sys.argv[1])
