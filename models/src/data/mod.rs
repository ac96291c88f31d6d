//! Text data for language models: tokenizers (bytes, GPT-2's BPE, a Hugging Face
//! tokenizer.json), corpora (a text file, a pre-tokenized file, the system's license texts or
//! generated text), memory-mapped token shards (nanoGPT's and llm.c's formats), held-out
//! splits, the windows of each step's batch (drawn from (seed, step) over a corpus, or read in
//! order from shards from a resumable position) sharded over the data-parallel ranks, and a
//! background prefetcher. Token ids are u32 in memory; files store them as u16 or u32, as
//! their headers say.
//!
//! Pre-tokenized format (`--data` files that start with the magic): the 8 bytes `OXFTOK16`
//! (`OXFTOK32`), the vocabulary size as a little-endian u32, then the token ids as
//! little-endian u16 (u32), each below the vocabulary size. Token files are told apart by their
//! headers (`header`), never by their names alone.

mod batches;
mod corpus;
mod error;
mod eval_windows;
mod generated;
mod header;
mod prefetch;
mod shards;
mod tokenizer;
mod tokenizer_json;
mod windows;

pub use batches::{Batch, WindowSampler};
pub use corpus::{write_pretokenized, Corpus, CorpusSource, HELDOUT_FRACTION, MAX_CORPUS_BYTES};
pub use error::DataError;
pub use eval_windows::EvalWindows;
pub use generated::generated_text;
pub use header::{
    identify, identify_file, IdWidth, LlmcHeader, TokenHeader, LLMC_GPT2, LLMC_HEADER_BYTES,
    LLMC_LLAMA3, PRETOKENIZED32_MAGIC, PRETOKENIZED_MAGIC,
};
pub use prefetch::{Prefetcher, PREFETCH_TIMEOUT};
pub use shards::{write_shard, Shard, ShardFormat, ShardSet};
pub use tokenizer::{ByteTokenizer, Gpt2Tokenizer, Tokenizer};
pub use tokenizer_json::{
    EndOfText, JsonTokenizer, END_OF_TEXT_NAMES, MAX_TOKENIZER_BYTES, TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
};
pub use windows::{ShardWindows, StreamOrigin, Windows};
