#!/usr/bin/env python3
"""Makes the tokenizer.json fixtures under tests/fixtures/tokenizers and their reference ids.

Needs only Hugging Face's `tokenizers` package (`pip install tokenizers`). Each tokenizer is a
small byte-level BPE trained on a fixed subset of the license texts every Debian/Ubuntu system
ships (/usr/share/common-licenses), so nothing is downloaded:

  gpt2-style/   GPT-2's pre-tokenizer (ByteLevel with its regex), `<|endoftext|>` as an added
                special token, no tokenizer_config.json (the end-of-text token is found among
                the added tokens).
  llama3-style/ Llama 3's pre-tokenizer regex (Split, isolated) then ByteLevel without its
                regex, `<|begin_of_text|>` prepended by a template post-processor, reserved
                special tokens, and a tokenizer_config.json naming bos/eos.
  qwen2-style/  Qwen2's: an NFC normalizer, its regex (single digits), `<|endoftext|>`,
                `<|im_start|>`, `<|im_end|>`; tokenizer_config.json with eos `<|im_end|>`.
  wide/         the gpt2-style tokenizer with every merged token and `<|endoftext|>` moved to
                ids above 65535 (70000 + n): its ids need 32 bits.

sample.txt is the text encoded; reference.json holds, per tokenizer, the ids of sample.txt
without special tokens (`ids`) and with them (`ids_with_special`), the ids of a few short
strings, the vocabulary size, the text decode(ids) gives and whether decode(encode(sample)) gave the text back.

Run from the repository root: python3 scripts/tokenizer_fixture.py
"""

import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors, trainers

OUT = os.path.join("tests", "fixtures", "tokenizers")
LICENSES = "/usr/share/common-licenses"
TRAIN_FILES = ["Apache-2.0", "BSD", "MPL-2.0", "GPL-3"]
VOCAB = 600

LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SAMPLE = """The quick brown fox jumps over the lazy dog. It's 2024; we'll see, they'd say.
Numbers: 0 7 42 1234567 3.14159 -273.15 1e-9 0x1F 2^31-1 = 2147483647.
    Indented   line\twith\ttabs   and  runs of   spaces.

Punctuation!?... (parentheses) [brackets] {braces} <angles> "quotes" 'single' `ticks` ~ @ # $ % & *
Accents: café, naïve, Ærøskøbing, Straße, façade. Décomposé: Cafe\u0301 (e + combining acute).
CJK: 你好，世界。日本語のテキスト。한국어 텍스트.
Emoji: 🦀🔥👍🏽 and a family 👨‍👩‍👧‍👦.
Special strings as text: <|endoftext|> <|begin_of_text|> <|im_end|> end.
Licence words: Licensor, Derivative Works, Contributor, warranty, MERCHANTABILITY, FITNESS.
Trailing spaces   
\r\nWindows line\r\nend
"""

SHORT = ["", " ", "hello", "Hello world", "  two leading", "trailing  ", "\n\n\n", "a1b22c333d4444"]


def text_files():
    return [os.path.join(LICENSES, f) for f in TRAIN_FILES]


def byte_level_trainer(special):
    return trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )


def gpt2_style():
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    t.decoder = decoders.ByteLevel()
    t.post_processor = processors.ByteLevel(trim_offsets=False)
    t.train(text_files(), byte_level_trainer(["<|endoftext|>"]))
    return t, None


def llama3_style():
    special = ["<|begin_of_text|>", "<|end_of_text|>"] + [
        f"<|reserved_special_token_{i}|>" for i in range(4)
    ]
    t = Tokenizer(models.BPE(ignore_merges=True))
    t.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    t.decoder = decoders.ByteLevel()
    t.train(text_files(), byte_level_trainer(special))
    bos = t.token_to_id("<|begin_of_text|>")
    t.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return t, config


def qwen2_style():
    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    t.decoder = decoders.ByteLevel()
    t.post_processor = processors.ByteLevel(trim_offsets=False)
    t.train(text_files(), byte_level_trainer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    config = {
        "bos_token": None,
        "eos_token": {"content": "<|im_end|>", "special": True},
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "Qwen2Tokenizer",
    }
    return t, config


WIDE_BASE = 70000


def wide(gpt2_json):
    """gpt2-style with the 256 byte tokens kept and every other id moved to WIDE_BASE + n."""
    doc = json.loads(gpt2_json)
    vocab = doc["model"]["vocab"]
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    moved = {}
    n = 0
    for tok, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        if tok in alphabet and len(tok) == 1:
            moved[tok] = i
        else:
            moved[tok] = WIDE_BASE + n
            n += 1
    doc["model"]["vocab"] = moved
    for a in doc["added_tokens"]:
        a["id"] = moved[a["content"]]
    return Tokenizer.from_str(json.dumps(doc)), None


def save(name, t, config):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    t.save(os.path.join(d, "tokenizer.json"), pretty=False)
    cfg = os.path.join(d, "tokenizer_config.json")
    if config is not None:
        with open(cfg, "w") as f:
            json.dump(config, f, indent=1)
            f.write("\n")
    elif os.path.exists(cfg):
        os.remove(cfg)
    # What the Rust side reads: the file as saved, reloaded.
    return Tokenizer.from_file(os.path.join(d, "tokenizer.json"))


def reference(t, sample):
    enc = t.encode(sample, add_special_tokens=False)
    ids = enc.ids
    vocab = t.get_vocab(with_added_tokens=True)
    return {
        "vocab_size": max(vocab.values()) + 1,
        "ids": ids,
        "ids_with_special": t.encode(sample, add_special_tokens=True).ids,
        "short": {s: t.encode(s, add_special_tokens=False).ids for s in SHORT},
        "decoded": t.decode(ids, skip_special_tokens=False),
        "lossless": t.decode(ids, skip_special_tokens=False) == sample,
        "max_id": max(ids),
    }


def main():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "sample.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(SAMPLE)
    made = {}
    g, _ = gpt2_style()
    made["gpt2-style"] = save("gpt2-style", g, None)
    for name, build in [("llama3-style", llama3_style), ("qwen2-style", qwen2_style)]:
        t, config = build()
        made[name] = save(name, t, config)
    w, _ = wide(made["gpt2-style"].to_str())
    made["wide"] = save("wide", w, None)
    ref = {name: reference(t, SAMPLE) for name, t in made.items()}
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(ref, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    for name, r in ref.items():
        print(f"{name}: vocab {r['vocab_size']}, {len(r['ids'])} ids of the sample, "
              f"max id {r['max_id']}, lossless {r['lossless']}")


if __name__ == "__main__":
    main()
