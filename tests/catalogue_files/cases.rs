//! The refusal cases: `train ARGS` run in the inputs folder and the fragment its refusal must
//! name.

use crate::common::argv;

/// The GPT of the checkpoints `gck` and `tck` (no sample) with `rest`.
fn tiny(rest: &[&'static str]) -> Vec<&'static str> {
    let mut v = argv("--width 32 --layers 1 --seq-len 16 --gen-tokens 0");
    v.extend_from_slice(rest);
    v
}

/// The cases: `train ARGS` (in the folder) and the fragment the refusal must name.
pub fn cases() -> Vec<(Vec<&'static str>, &'static str)> {
    vec![
        // An output over an input, however it is named.
        (vec!["--data", "c.txt", "--metrics", "c.txt"], "is --data's"),
        (
            vec!["--data", "c.txt", "--metrics", "./c.txt"],
            "is --data's",
        ),
        (
            vec!["--data", "./c.txt", "--metrics", "sub/../c.txt"],
            "is --data's",
        ),
        (
            vec!["--data", "c.txt", "--metrics", "hard.txt"],
            "is --data's",
        ),
        (
            vec!["--data", "c.txt", "--metrics", "sub/up/c.txt"],
            "is --data's",
        ),
        (
            vec!["--data", "c.txt", "--metrics", "link.jsonl"],
            "is a symlink",
        ),
        (
            vec!["--data", "ok.bin", "--metrics", "ok.bin"],
            "is --data's",
        ),
        (
            argv("--data ok.bin --val-data val.bin --metrics val.bin"),
            "is --val-data's",
        ),
        (
            vec!["--config", "j.config.toml", "--metrics", "j.config.toml"],
            "is --config's",
        ),
        (
            vec!["--data", "ok.bin", "--val-data", "./ok.bin"],
            "held-out data must not be trained on",
        ),
        (
            vec!["--data", "set/*.bin", "--val-data", "set/b.bin"],
            "held-out data must not be trained on",
        ),
        (
            vec!["--model", "mlp", "--config", "j.config.toml", "--save", "j"],
            "is --config's",
        ),
        (vec!["--data", "s.lock", "--save", "s"], "is --data's"),
        (
            vec!["--data", "ck/manifest.json", "--save", "ck"],
            "which a save replaces",
        ),
        (
            argv("--model mlp --resume ck --metrics ck/manifest.json"),
            "lies inside --resume's",
        ),
        (
            vec!["--model", "mlp", "--resume", "ck", "--plot", "ck/loss.svg"],
            "lies inside --resume's",
        ),
        // Two outputs on one file.
        (
            vec!["--model", "mlp", "--metrics", "m.svg", "--plot", "m.svg"],
            "two outputs never share",
        ),
        (
            vec!["--model", "mlp", "--metrics", "m.svg", "--plot", "./m.svg"],
            "two outputs never share",
        ),
        (
            argv("--model mlp --metrics ck2/m.jsonl --save ck2"),
            "two outputs never share",
        ),
        (
            argv("--model mlp --metrics ck2.config.toml --save ck2"),
            "two outputs never share",
        ),
        (
            vec!["--model", "mlp", "--save", "ck3", "--metrics", "ck3.lock"],
            "two outputs never share",
        ),
        // Outputs of another run, or no run's.
        (
            vec!["--model", "mlp", "--metrics", "other.jsonl"],
            "holds the records of run feedface00000000",
        ),
        (
            vec!["--model", "mlp", "--metrics", "notes.txt"],
            "names no run",
        ),
        (
            vec!["--model", "mlp", "--plot", "other.svg"],
            "is the plot of run feedface00000000",
        ),
        (
            vec!["--model", "mlp", "--plot", "drawing.svg"],
            "names no run",
        ),
        (
            argv("--model mlp --resume ck --steps 4 --metrics other.jsonl"),
            "holds the records of run feedface00000000",
        ),
        // Token files by header: damaged headers named by field, pre-tokenized files never
        // read as ids, raw ids only where nothing else is.
        (
            vec!["--data", "flip.bin"],
            "damaged llm.c header: its magic (bytes 0..4)",
        ),
        (
            vec!["--data", "flip.bin", "--shard-format", "llmc"],
            "the llm.c header's magic (bytes 0..4) is 20241032",
        ),
        (
            vec!["--data", "preflip.bin"],
            "damaged pre-tokenized header: its magic (bytes 0..8)",
        ),
        (vec!["--data", "version.bin"], "version (bytes 4..8) is 2"),
        (
            vec!["--data", "count.bin"],
            "token count (bytes 8..12) is 4007",
        ),
        (
            vec!["--data", "pre50k.bin"],
            "vocabulary size (bytes 8..12) is 50257, more than the bytes tokenizer's 256",
        ),
        (
            vec!["--data", "pre.txt"],
            "vocabulary size (bytes 8..12) is 50257",
        ),
        (
            vec!["--data", "pre.bin", "--shard-format", "raw"],
            "--shard-format (data.shard-format)",
        ),
        (vec!["--data", "pre*.bin"], "not a token shard"),
        (
            vec!["--data", "ok.bin", "--shard-format", "llmc"],
            "magic (bytes 0..4) is 65536",
        ),
        (
            vec!["--data", "llmc.bin", "--shard-format", "raw"],
            "starts with llm.c's magic",
        ),
        (
            vec!["--data", "l3flip.bin"],
            "damaged llm.c header: its magic (bytes 0..4) is 20241313, 1 bit(s) away from \
             llm.c's 20240801",
        ),
        (
            vec!["--data", "l3flip.bin", "--shard-format", "llmc"],
            "the llm.c header's magic (bytes 0..4) is 20241313, neither",
        ),
        (
            vec!["--data", "l3version.bin"],
            "version (bytes 4..8) is 2, not 7",
        ),
        (
            vec!["--data", "l3count.bin"],
            "token count (bytes 8..12) is 4008 (17056 bytes with the header, u32 ids)",
        ),
        (
            vec!["--data", "l3.bin"],
            "at byte 17024: token 4000 is id 70000, not below the vocabulary size 256",
        ),
        (
            vec!["--data", "l3.bin", "--tokenizer", "tok"],
            "token 4000 is id 70000, not below the vocabulary size 600",
        ),
        (
            vec!["--data", "l3.bin", "--shard-format", "raw"],
            "starts with llm.c's magic 20240801",
        ),
        (
            vec!["--data", "mix/*.bin", "--tokenizer", "tokw"],
            "holds u32 ids but the set's first shard",
        ),
        // u16 ids cannot be a tokenizer's whose ids need u32: shards of another tokenizer.
        (
            vec!["--data", "llmc.bin", "--tokenizer", "tokw"],
            "llmc.bin at byte 0: holds u16 ids (llm.c's GPT-2 format, at most 65536 ids) but \
             the tokenizer's vocabulary has 70344 ids",
        ),
        (
            vec!["--data", "ok.bin", "--tokenizer", "tokw"],
            "ok.bin at byte 0: holds u16 ids (nanoGPT's raw format",
        ),
        (
            argv("--data l3.bin --val-data llmc.bin --tokenizer tokw"),
            "llmc.bin at byte 0: holds u16 ids",
        ),
        (
            vec!["--data", "pre32.bin"],
            "vocabulary size (bytes 8..12) is 70344, more than the bytes tokenizer's 256",
        ),
        (
            vec!["--data", "pre32.bin", "--tokenizer", "tok"],
            "vocabulary size (bytes 8..12) is 70344, more than the",
        ),
        (
            vec!["--data", "pre32flip.bin"],
            "damaged pre-tokenized header: its magic (bytes 0..8)",
        ),
        // Tokenizer files that cannot be used.
        (
            vec!["--data", "c.txt", "--tokenizer", "nope.json"],
            "--tokenizer nope.json: not bytes or gpt2",
        ),
        (
            vec!["--data", "c.txt", "--tokenizer", "sub"],
            "a directory without a tokenizer.json",
        ),
        (
            vec!["--data", "c.txt", "--tokenizer", "notes.txt"],
            "not a tokenizer.json the tokenizers library reads",
        ),
        (
            argv("prepare --out pp --tokenizer dropbyte.json c.txt"),
            "tokenizer dropbyte.json: a byte-level BPE without unk_token or byte_fallback whose \
             vocabulary lacks 1 of the 256 byte characters",
        ),
        // An input among the shards prepare writes would be overwritten before it is read.
        (
            vec!["prepare", "--out", "pq", "c.txt", "pq_000000.bin"],
            "prepare pq_000000.bin: is ",
        ),
        (
            vec!["prepare", "--out", "sub/../pq", "c.txt", "pqlink.txt"],
            "pq_000000.bin, a shard name of --out sub/../pq (sub/../pq_NNNNNN.bin)",
        ),
        (
            vec!["--data", "c.txt", "--tokenizer", "empty.json"],
            "tokenizer empty.json: not a tokenizer.json the tokenizers library reads",
        ),
        (
            vec!["prepare", "--out", "pp", "--tokenizer", "emptytok", "c.txt"],
            "tokenizer emptytok/tokenizer.json: not a tokenizer.json",
        ),
        (
            vec!["--data", "c.txt", "--tokenizer", "badeos"],
            "its eos_token \"<|nope|>\" is no token",
        ),
        (
            vec!["--data", "c.txt", "--tokenizer", ""],
            "empty: give bytes, gpt2",
        ),
        (
            argv("prepare --out pp --format raw --tokenizer tokw c.txt"),
            "--format raw holds u16 ids",
        ),
        (
            argv("prepare --out pp --tokenizer notes.txt c.txt"),
            "--tokenizer notes.txt",
        ),
        // Resumes onto something else than the checkpoint's run.
        (
            tiny(&["--resume", "gck", "--data", "val.bin", "--steps", "4"]),
            "--data file 1 was",
        ),
        (
            tiny(&["--resume", "gck", "--data", "set/*.bin", "--steps", "4"]),
            "but this run reads 2",
        ),
        (
            tiny(&argv(
                "--resume gck --data set/a.bin --batch-size 8 --steps 4",
            )),
            "saved with batch_size 16 but this run has --batch-size 8",
        ),
        (
            tiny(&argv(
                "--resume gck --data set/a.bin --tokenizer gpt2 --steps 4",
            )),
            "saved with tokenizer bytes but this run has --tokenizer gpt2",
        ),
        (
            tiny(&argv(
                "--resume gck --data set/a.bin --tokenizer tok --steps 4",
            )),
            "saved with tokenizer bytes but this run has --tokenizer sha256:",
        ),
        (
            tiny(&argv(
                "--resume tck --data c.txt --tokenizer tok3 --steps 4",
            )),
            "tok/tokenizer.json but this run has --tokenizer sha256:",
        ),
        (
            argv("--width 32 --layers 1 --seq-len 16 --resume tck --tokenizer tok3 --generate hi"),
            "tok/tokenizer.json or --allow-resume-mismatch",
        ),
        (
            tiny(&argv(
                "--resume gck --data set/a.bin --val-data set/b.bin --steps 4",
            )),
            "saved reading no --val-data file but this run reads",
        ),
        (
            vec!["--model", "mlp", "--resume", "ck", "--batch-size", "32"],
            "batch_size 64",
        ),
        // Manifests edited with their checksum recomputed.
        (
            vec!["--model", "mlp", "--resume", "ck-step"],
            "optimizer.step_count 2 is beyond metadata step 1",
        ),
        (
            vec!["--model", "mlp", "--resume", "ck-datastep"],
            "metadata data.step \"2\" is not its step 3",
        ),
        (
            vec!["--model", "mlp", "--resume", "ck-reset"],
            "optimizer.empty lists",
        ),
        (
            vec!["--model", "mlp", "--resume", "ck-swap"],
            "has shape [4] but its parameter mlp.fc1.bias has [64]",
        ),
    ]
}
