//! `train prepare`: text files to token shards. Each file is one document, preceded by the
//! tokenizer's end-of-text token when it has one (GPT-2's `<|endoftext|>`, as nanoGPT's and
//! llm.c's preparation scripts do; a tokenizer.json's, see `JsonTokenizer`); without one the
//! documents follow each other unseparated, as the summary says. The ids fill shards of
//! `--shard-tokens` ids named `PREFIX_000000.bin`, `PREFIX_000001.bin`, ... in llm.c's format
//! (or raw), u16 ids when the vocabulary fits them (llm.c's GPT-2 header), else u32 (llm.c's
//! Llama 3 header; the raw format holds u16 only), with a progress bar over the input bytes.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use oxiflow_models::data::{write_shard, IdWidth, LlmcHeader, ShardFormat, MAX_CORPUS_BYTES};

use crate::config::{parse, ShardFormatArg, TokenizerArg};
use crate::error::TrainError;

/// Tokenize text files into token shards.
#[derive(Args, Clone, Debug)]
pub struct PrepareArgs {
    /// The shards' path prefix: PREFIX_000000.bin, PREFIX_000001.bin, ...
    #[arg(long)]
    pub out: PathBuf,
    /// The tokenizer: bytes, gpt2, or a Hugging Face tokenizer.json (its path, or a directory
    /// holding one).
    #[arg(long, default_value_t = TokenizerArg::Bytes)]
    pub tokenizer: TokenizerArg,
    /// The shards' layout (auto: llm.c's).
    #[arg(long, value_enum, default_value = "llmc")]
    pub format: ShardFormatArg,
    /// Ids per shard (the last one holds the rest).
    #[arg(long, default_value_t = 100_000_000, value_parser = parse::positive_usize)]
    pub shard_tokens: usize,
    /// Text files, one document each.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
}

fn io_err(path: &Path, e: std::io::Error) -> TrainError {
    TrainError::Output {
        what: "prepare",
        path: path.to_path_buf(),
        detail: e.to_string(),
    }
}

/// Whether `name` is a shard `prepare` writes for the prefix file name `stem`
/// (`STEM_NNNNNN.bin`, six or more digits) or the temporary file of one (`.bin.tmp`).
fn is_shard_name(stem: &str, name: &str) -> bool {
    let Some(rest) = name.strip_prefix(stem).and_then(|r| r.strip_prefix('_')) else {
        return false;
    };
    let digits = rest
        .strip_suffix(".bin")
        .or_else(|| rest.strip_suffix(".bin.tmp"));
    digits.is_some_and(|d| d.len() >= 6 && d.bytes().all(|b| b.is_ascii_digit()))
}

/// An input that is (or, through links, resolves to) one of the shards `out` names would be
/// overwritten before it is read: an error naming it.
fn refuse_inputs_among_shards(out: &Path, inputs: &[PathBuf]) -> Result<(), TrainError> {
    let (Some(stem), parent) = (out.file_name().and_then(|n| n.to_str()), out.parent()) else {
        return Ok(());
    };
    let parent = match parent {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let Ok(dir) = std::fs::canonicalize(parent) else {
        return Ok(());
    };
    for p in inputs {
        let Ok(real) = std::fs::canonicalize(p) else {
            continue;
        };
        let name = real.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if real.parent() == Some(dir.as_path()) && is_shard_name(stem, name) {
            return Err(TrainError::Output {
                what: "prepare",
                path: p.clone(),
                detail: format!(
                    "is {}, a shard name of --out {} ({}_NNNNNN.bin), which this run writes: \
                     it would be overwritten before it is read; choose another --out",
                    real.display(),
                    out.display(),
                    out.display()
                ),
            });
        }
    }
    Ok(())
}

/// The shards `args` asks for; returns their paths.
pub fn run(args: &PrepareArgs) -> Result<Vec<PathBuf>, TrainError> {
    let tokenizer = args.tokenizer.open()?;
    let format = match args.format {
        ShardFormatArg::Raw => ShardFormat::Raw,
        _ => ShardFormat::Llmc,
    };
    let width = IdWidth::for_vocab(tokenizer.vocab());
    if format == ShardFormat::Raw && width != IdWidth::U16 {
        return Err(TrainError::Config {
            detail: format!(
                "--format raw holds u16 ids (nanoGPT's format) but --tokenizer {} has {} ids, \
                 which need u32: use --format llmc (llm.c's header for them: {})",
                args.tokenizer,
                tokenizer.vocab(),
                LlmcHeader::of_width(width).describe()
            ),
        });
    }
    // Every input is checked before anything is written.
    let mut total = 0u64;
    for p in &args.inputs {
        let meta = std::fs::metadata(p).map_err(|e| io_err(p, e))?;
        if !meta.is_file() || meta.len() > MAX_CORPUS_BYTES {
            return Err(TrainError::Output {
                what: "prepare",
                path: p.clone(),
                detail: format!("not a regular file of at most {MAX_CORPUS_BYTES} bytes"),
            });
        }
        total += meta.len();
    }
    refuse_inputs_among_shards(&args.out, &args.inputs)?;
    let bar = ProgressBar::new(total);
    if std::io::stderr().is_terminal() {
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
    } else {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let shard_path = |i: usize| PathBuf::from(format!("{}_{i:06}.bin", args.out.display()));
    let mut written = Vec::new();
    let mut pending: Vec<u32> = Vec::with_capacity(args.shard_tokens.min(1 << 24));
    let mut tokens = 0u64;
    for p in &args.inputs {
        bar.set_message(p.display().to_string());
        let bytes = std::fs::read(p).map_err(|e| io_err(p, e))?;
        pending.extend(tokenizer.end_of_text());
        pending.extend(tokenizer.encode_bytes(&bytes)?);
        while pending.len() >= args.shard_tokens {
            let rest = pending.split_off(args.shard_tokens);
            let path = shard_path(written.len());
            write_shard(&path, format, width, &pending)?;
            tokens += pending.len() as u64;
            written.push(path);
            pending = rest;
        }
        bar.inc(bytes.len() as u64);
    }
    if !pending.is_empty() || written.is_empty() {
        let path = shard_path(written.len());
        write_shard(&path, format, width, &pending)?;
        tokens += pending.len() as u64;
        written.push(path);
    }
    bar.finish_and_clear();
    let stale = (written.len()..)
        .map(shard_path)
        .take_while(|p| p.exists())
        .count();
    if stale > 0 {
        eprintln!(
            "prepare: warning: {stale} shard(s) from an earlier run remain after the last one \
             written, from {}: a glob over {}_*.bin would read them too",
            shard_path(written.len()).display(),
            args.out.display()
        );
    }
    let layout = match format {
        ShardFormat::Raw => "raw shards of u16 ids (nanoGPT's format)".to_string(),
        _ => {
            let h = LlmcHeader::of_width(width);
            format!(
                "llmc shards of {width} ids (llm.c's {} header: magic {}, version {})",
                h.model, h.magic, h.version
            )
        }
    };
    let separator = match tokenizer.describe_end_of_text() {
        Some(e) => format!("each document after {e}"),
        None => "documents not separated (the tokenizer has no end-of-text token)".into(),
    };
    println!(
        "prepare: {} files ({total} bytes) -> {tokens} tokens of tokenizer {} (vocabulary {}; \
         {separator}) in {} {layout}: {} .. {}",
        args.inputs.len(),
        args.tokenizer,
        tokenizer.vocab(),
        written.len(),
        written[0].display(),
        written[written.len() - 1].display()
    );
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_names_are_told_from_other_files() {
        for name in ["w_000000.bin", "w_000123.bin.tmp", "w_1000000.bin"] {
            assert!(is_shard_name("w", name), "{name}");
        }
        for name in [
            "w_00000.bin",
            "w_000000.txt",
            "x_000000.bin",
            "w000000.bin",
            "w_00a000.bin",
        ] {
            assert!(!is_shard_name("w", name), "{name}");
        }
    }
}
