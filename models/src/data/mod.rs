//! Text data for language models: a byte-level tokenizer, corpora (a text file, a
//! pre-tokenized file, the system's license texts or generated text), a held-out split, and
//! batches of windows drawn deterministically from (seed, step) and sharded over the
//! data-parallel ranks.
//!
//! Pre-tokenized format (`--data` files that start with the magic): the 8 bytes `OXFTOK16`,
//! the vocabulary size as a little-endian u32, then the token ids as little-endian u16, each
//! below the vocabulary size. Any other file is text, one token per byte.

mod batches;
mod corpus;
mod error;
mod generated;
mod tokenizer;

pub use batches::{Batch, WindowSampler};
pub use corpus::{Corpus, CorpusSource, MAX_CORPUS_BYTES, PRETOKENIZED_MAGIC};
pub use error::DataError;
pub use generated::generated_text;
pub use tokenizer::ByteTokenizer;
