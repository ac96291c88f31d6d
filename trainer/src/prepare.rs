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
