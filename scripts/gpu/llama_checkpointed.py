"""The Llama anchor (llama_bench.py, beside this file on the device) with transformers' gradient
checkpointing on every decoder layer: the torch twin of `gpt_bench --recompute full` for long
sequences, where the anchor without checkpointing may not fit. Same flags and RESULT line.
"""
import sys

import transformers as tf

import llama_bench


class CheckpointedLlama(tf.LlamaForCausalLM):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


tf.LlamaForCausalLM = CheckpointedLlama
if __name__ == "__main__":
    sys.exit(llama_bench.main())
