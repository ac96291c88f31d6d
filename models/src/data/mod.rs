//! Text data for language models: tokenizers (bytes, GPT-2's BPE), corpora (a text file, a
//! pre-tokenized file, the system's license texts or generated text), memory-mapped token
//! shards (nanoGPT's and llm.c's formats), held-out splits, the windows of each step's batch
//! (drawn from (seed, step) over a corpus, or read in order from shards from a resumable
//! position) sharded over the data-parallel ranks, and a background prefetcher.
//!
//! Pre-tokenized format (`--data` files that start with the magic): the 8 bytes `OXFTOK16`,
//! the vocabulary size as a little-endian u32, then the token ids as little-endian u16, each
//! below the vocabulary size. Token files are told apart by their headers (`header`), never by
//! their names alone.

mod batches;
mod corpus;
mod error;
mod eval_windows;
mod generated;
mod header;
mod prefetch;
mod shards;
mod tokenizer;
mod windows;

pub use batches::{Batch, WindowSampler};
pub use corpus::{Corpus, CorpusSource, HELDOUT_FRACTION, MAX_CORPUS_BYTES, PRETOKENIZED_MAGIC};
pub use error::DataError;
pub use eval_windows::EvalWindows;
pub use generated::generated_text;
pub use header::{identify, identify_file, TokenHeader};
pub use prefetch::{Prefetcher, PREFETCH_TIMEOUT};
pub use shards::{
    write_shard, Shard, ShardFormat, ShardSet, LLMC_HEADER_BYTES, LLMC_MAGIC, LLMC_VERSION,
};
pub use tokenizer::{ByteTokenizer, Gpt2Tokenizer, Tokenizer};
pub use windows::{ShardWindows, StreamOrigin, Windows};
