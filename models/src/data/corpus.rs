//! `Corpus`: the token ids of a text or pre-tokenized file, of the license texts under
//! /usr/share/common-licenses, or of generated text (text through a `Tokenizer`); its held-out
//! split and unigram entropy.

use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::error::DataError;
use super::generated::generated_text;
use super::header::{
    identify, IdWidth, TokenHeader, LLMC_HEADER_BYTES, PRETOKENIZED32_MAGIC, PRETOKENIZED_MAGIC,
};
use super::shards::write_atomically;
use super::tokenizer::Tokenizer;

/// The largest corpus file read (bytes); larger files are refused.
pub const MAX_CORPUS_BYTES: u64 = 1 << 30;
/// The license texts every Debian/Ubuntu system ships.
const SYSTEM_LICENSES: &str = "/usr/share/common-licenses";
/// Size of the generated text used when no corpus is at hand.
const GENERATED_BYTES: usize = 200_000;
/// The fraction of the tokens (at the end) held out for evaluation.
pub const HELDOUT_FRACTION: f64 = 0.1;

/// Where a corpus came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CorpusSource {
    /// A text file (one token per byte).
    Text(PathBuf),
    /// A pre-tokenized file.
    Pretokenized(PathBuf),
    /// The regular files of a directory of texts, sorted by name and concatenated.
    Directory { path: PathBuf, files: usize },
    /// Generated text from this seed.
    Generated { seed: u64 },
}

impl std::fmt::Display for CorpusSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CorpusSource::Text(p) => write!(f, "text file {}", p.display()),
            CorpusSource::Pretokenized(p) => write!(f, "pre-tokenized file {}", p.display()),
            CorpusSource::Directory { path, files } => {
                write!(f, "{files} files under {}", path.display())
            }
            CorpusSource::Generated { seed } => write!(f, "generated text (seed {seed})"),
        }
    }
}

/// Token ids, their vocabulary size and the split point of the held-out part.
#[derive(Clone, Debug)]
pub struct Corpus {
    tokens: Arc<[u32]>,
    vocab: usize,
    heldout_start: usize,
    pub source: CorpusSource,
}

fn read_capped(op: &'static str, path: &Path) -> Result<Vec<u8>, DataError> {
    let io = |source| DataError::Io {
        op,
        path: path.to_path_buf(),
        source,
    };
    // Only regular files: a FIFO or device would block or never end.
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(DataError::Format {
            op,
            path: path.to_path_buf(),
            detail: "not a regular file".into(),
        });
    }
    let file = std::fs::File::open(path).map_err(io)?;
    let mut bytes = Vec::new();
    file.take(MAX_CORPUS_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > MAX_CORPUS_BYTES {
        return Err(DataError::Format {
            op,
            path: path.to_path_buf(),
            detail: format!("larger than the {MAX_CORPUS_BYTES}-byte limit"),
        });
    }
    Ok(bytes)
}

impl Corpus {
    /// A corpus of `tokens` below `vocab`, the last `HELDOUT_FRACTION` held out.
    fn new(tokens: Vec<u32>, vocab: usize, source: CorpusSource) -> Corpus {
        let held = (tokens.len() as f64 * HELDOUT_FRACTION).ceil() as usize;
        Corpus {
            heldout_start: tokens.len().saturating_sub(held),
            tokens: tokens.into(),
            vocab,
            source,
        }
    }

    /// `text` through `tokenizer`.
    pub fn from_text(
        text: &str,
        source: CorpusSource,
        tokenizer: &Tokenizer,
    ) -> Result<Corpus, DataError> {
        // UTF-8 text encodes as its bytes do (`Tokenizer::encode_bytes`).
        Corpus::from_bytes(text.as_bytes(), source, tokenizer)
    }

    /// A file's bytes through `tokenizer` (`Tokenizer::encode_bytes`).
    fn from_bytes(
        bytes: &[u8],
        source: CorpusSource,
        tokenizer: &Tokenizer,
    ) -> Result<Corpus, DataError> {
        Ok(Corpus::new(
            tokenizer.encode_bytes(bytes)?,
            tokenizer.vocab(),
            source,
        ))
    }

    /// A text file through `tokenizer`, or a pre-tokenized file when it starts with
    /// `OXFTOK16` or `OXFTOK32` (its own vocabulary, at most the tokenizer's, which decodes its
    /// samples). A damaged header (see `header`) or an llm.c shard is refused.
    pub fn from_path(path: &Path, tokenizer: &Tokenizer) -> Result<Corpus, DataError> {
        let op = "corpus";
        let bytes = read_capped(op, path)?;
        let bad = |detail: String| DataError::Format {
            op,
            path: path.to_path_buf(),
            detail,
        };
        let head = &bytes[..bytes.len().min(LLMC_HEADER_BYTES)];
        let width = match identify(head, bytes.len() as u64).map_err(&bad)? {
            TokenHeader::Llmc(_) => {
                return Err(bad(
                    "an llm.c token shard, which is read as shards (a path ending in .bin, or \
                     a glob)"
                        .into(),
                ))
            }
            TokenHeader::Pretokenized(width) => width,
            TokenHeader::None => {
                let src = CorpusSource::Text(path.to_path_buf());
                return Corpus::from_bytes(&bytes, src, tokenizer);
            }
        };
        let rest = &bytes[PRETOKENIZED_MAGIC.len()..];
        let (head, ids) = rest.split_first_chunk::<4>().ok_or_else(|| {
            bad("the pre-tokenized header ends before its vocabulary size (bytes 8..12)".into())
        })?;
        let vocab = u32::from_le_bytes(*head) as u64;
        if vocab == 0 || vocab > width.capacity() {
            return Err(bad(format!(
                "the pre-tokenized header's vocabulary size (bytes 8..12) is {vocab}, not in \
                 1..={} ({width} ids)",
                width.capacity()
            )));
        }
        let vocab = vocab as usize;
        if vocab > tokenizer.vocab() {
            return Err(bad(format!(
                "the pre-tokenized header's vocabulary size (bytes 8..12) is {vocab}, more than \
                 the {} tokenizer's {} ids: it was made with another tokenizer (choose that one)",
                tokenizer,
                tokenizer.vocab()
            )));
        }
        if ids.len() % width.bytes() != 0 {
            return Err(bad(format!(
                "{} id bytes: not whole {width} ids",
                ids.len()
            )));
        }
        let tokens: Vec<u32> = width.decode(ids).collect();
        if let Some((i, id)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(bad(format!(
                "token {i} is {id}, not below the vocabulary size {vocab}"
            )));
        }
        Ok(Corpus::new(
            tokens,
            vocab,
            CorpusSource::Pretokenized(path.to_path_buf()),
        ))
    }

    /// The regular files (not links) of `dir`, sorted by name and joined by newlines, through
    /// `tokenizer`.
    pub fn from_directory(dir: &Path, tokenizer: &Tokenizer) -> Result<Corpus, DataError> {
        let op = "corpus folder";
        let io = |source| DataError::Io {
            op,
            path: dir.to_path_buf(),
            source,
        };
        let mut files = Vec::new();
        for e in std::fs::read_dir(dir).map_err(io)? {
            let e = e.map_err(io)?;
            if e.file_type().map_err(io)?.is_file() {
                files.push(e.path());
            }
        }
        files.sort();
        let mut text = Vec::new();
        for f in &files {
            text.extend(read_capped(op, f)?);
            text.push(b'\n');
            if text.len() as u64 > MAX_CORPUS_BYTES {
                return Err(DataError::Format {
                    op,
                    path: dir.to_path_buf(),
                    detail: format!("larger than the {MAX_CORPUS_BYTES}-byte limit"),
                });
            }
        }
        let src = CorpusSource::Directory {
            path: dir.to_path_buf(),
            files: files.len(),
        };
        Corpus::from_bytes(&text, src, tokenizer)
    }

    /// The default corpus, needing no download: the license texts under
    /// /usr/share/common-licenses when that directory has any, else generated text from `seed`.
    pub fn default_corpus(seed: u64, tokenizer: &Tokenizer) -> Result<Corpus, DataError> {
        match Corpus::from_directory(Path::new(SYSTEM_LICENSES), tokenizer) {
            Ok(c) if !c.is_empty() => Ok(c),
            _ => Corpus::from_text(
                &generated_text(seed, GENERATED_BYTES),
                CorpusSource::Generated { seed },
                tokenizer,
            ),
        }
    }

    /// All token ids (shared).
    pub fn tokens(&self) -> Arc<[u32]> {
        Arc::clone(&self.tokens)
    }
    /// The positions of the training tokens in `tokens()`.
    pub fn train_range(&self) -> Range<usize> {
        0..self.heldout_start
    }
    /// The positions of the held-out tokens in `tokens()`.
    pub fn heldout_range(&self) -> Range<usize> {
        self.heldout_start..self.tokens.len()
    }

    /// Number of token ids.
    pub fn vocab(&self) -> usize {
        self.vocab
    }
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
    /// The training tokens (all but the held-out end).
    pub fn train(&self) -> &[u32] {
        &self.tokens[..self.heldout_start]
    }
    /// The held-out tokens (the last `HELDOUT_FRACTION`).
    pub fn heldout(&self) -> &[u32] {
        &self.tokens[self.heldout_start..]
    }

    /// Entropy (nats) of the token frequencies of `tokens`: the loss of the best model that
    /// ignores context.
    pub fn unigram_entropy(tokens: &[u32]) -> f64 {
        // In id order, so the sum is the same on every run and rank.
        let mut counts: std::collections::BTreeMap<u32, u64> = std::collections::BTreeMap::new();
        for &t in tokens {
            *counts.entry(t).or_default() += 1;
        }
        let n = tokens.len() as f64;
        counts
            .values()
            .map(|&c| {
                let p = c as f64 / n;
                -p * p.ln()
            })
            .sum()
    }
}

/// Writes `ids`, each below `vocab`, to `path` as a pre-tokenized file: `OXFTOK16` when the
/// vocabulary fits u16 ids, else `OXFTOK32` (see the module docs of `data`); returns the width
/// written. An id at or above `vocab` is an error and nothing is written.
pub fn write_pretokenized(path: &Path, vocab: usize, ids: &[u32]) -> Result<IdWidth, DataError> {
    let bad = |detail: String| DataError::Format {
        op: "write_pretokenized",
        path: path.to_path_buf(),
        detail,
    };
    let v = u32::try_from(vocab)
        .ok()
        .filter(|&v| v > 0)
        .ok_or_else(|| bad(format!("vocabulary size {vocab} is not in 1..=4294967295")))?;
    if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id >= v) {
        return Err(bad(format!(
            "token {i} is {id}, not below the vocabulary size {vocab}"
        )));
    }
    let width = IdWidth::for_vocab(vocab);
    let magic = match width {
        IdWidth::U16 => PRETOKENIZED_MAGIC,
        IdWidth::U32 => PRETOKENIZED32_MAGIC,
    };
    let mut bytes = magic.to_vec();
    bytes.extend(v.to_le_bytes());
    width
        .encode_into(ids, &mut bytes)
        .map_err(|(i, id)| bad(format!("token {i} is {id}, which does not fit {width}")))?;
    write_atomically("write_pretokenized", path, &bytes)?;
    Ok(width)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str, bytes: &[u8]) -> PathBuf {
        let p = std::env::temp_dir().join(format!("oxiflow-corpus-{}-{name}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn pretokenized_files_are_read_and_checked() {
        let mut b = PRETOKENIZED_MAGIC.to_vec();
        b.extend(300u32.to_le_bytes());
        for id in [1u16, 299, 7] {
            b.extend(id.to_le_bytes());
        }
        let p = temp("ok", &b);
        let c = Corpus::from_path(&p, &Tokenizer::Gpt2).unwrap();
        assert_eq!((c.vocab(), c.len()), (300, 3));
        let e = Corpus::from_path(&p, &Tokenizer::Bytes)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("vocabulary size (bytes 8..12) is 300, more than the bytes tokenizer's 256"),
            "{e}"
        );
        b.extend(300u16.to_le_bytes());
        let p2 = temp("bad", &b);
        let e = Corpus::from_path(&p2, &Tokenizer::Gpt2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("token 3 is 300"), "{e}");
        b.push(0);
        let p3 = temp("odd", &b);
        assert!(Corpus::from_path(&p3, &Tokenizer::Gpt2).is_err());
        for p in [p, p2, p3] {
            let _ = std::fs::remove_file(p);
        }
    }

    #[test]
    fn pretokenized_files_of_either_width_round_trip() {
        let wide: Vec<u32> = (0..1000u32).map(|i| i * 131 % 151_936).collect();
        let p = temp("wide", b"");
        assert_eq!(
            write_pretokenized(&p, 151_936, &wide).unwrap(),
            IdWidth::U32
        );
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[..12], b"OXFTOK32\x80\x51\x02\x00");
        assert_eq!(bytes.len(), 12 + 4 * 1000);
        let big = Tokenizer::from_file(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tokenizers/wide"
        )))
        .unwrap();
        // The wide fixture's 70,344 ids are too few for a 151,936-id file.
        let e = Corpus::from_path(&p, &big).unwrap_err().to_string();
        assert!(e.contains("is 151936, more than the"), "{e}");
        let small: Vec<u32> = wide.iter().map(|i| i % 70_344).collect();
        assert_eq!(
            write_pretokenized(&p, 70_344, &small).unwrap(),
            IdWidth::U32
        );
        let c = Corpus::from_path(&p, &big).unwrap();
        assert_eq!((c.vocab(), &c.tokens()[..]), (70_344, &small[..]));
        let narrow: Vec<u32> = small.iter().map(|i| i % 300).collect();
        assert_eq!(write_pretokenized(&p, 300, &narrow).unwrap(), IdWidth::U16);
        assert_eq!(&std::fs::read(&p).unwrap()[..8], b"OXFTOK16");
        let c = Corpus::from_path(&p, &Tokenizer::Gpt2).unwrap();
        assert_eq!(&c.tokens()[..], &narrow[..]);
        assert!(write_pretokenized(&p, 300, &small).is_err());
        // An OXFTOK32 file whose id bytes are not whole u32 ids, or an id past its vocabulary.
        let mut b = b"OXFTOK32".to_vec();
        b.extend(70_344u32.to_le_bytes());
        b.extend(70_343u32.to_le_bytes());
        b.extend([1, 0]);
        std::fs::write(&p, &b).unwrap();
        let e = Corpus::from_path(&p, &big).unwrap_err().to_string();
        assert!(e.contains("6 id bytes: not whole u32 ids"), "{e}");
        b.truncate(16);
        b.extend(70_344u32.to_le_bytes());
        std::fs::write(&p, &b).unwrap();
        let e = Corpus::from_path(&p, &big).unwrap_err().to_string();
        assert!(e.contains("token 1 is 70344, not below"), "{e}");
        let _ = std::fs::remove_file(p);
    }

    #[test]
    fn text_files_are_bytes_and_the_end_is_held_out() {
        let p = temp("text", b"abcdefghij");
        let c = Corpus::from_path(&p, &Tokenizer::Bytes).unwrap();
        assert_eq!(
            c.train(),
            "abcdefghi"
                .as_bytes()
                .iter()
                .map(|&b| u32::from(b))
                .collect::<Vec<_>>()
        );
        assert_eq!(c.heldout(), [u32::from(b'j')]);
        let g = Corpus::from_path(&p, &Tokenizer::Gpt2).unwrap();
        assert_eq!(g.vocab(), 50257);
        assert!(std::fs::create_dir_all(std::env::temp_dir()).is_ok());
        let e = Corpus::from_path(&std::env::temp_dir(), &Tokenizer::Bytes).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let _ = std::fs::remove_file(p);
    }

    #[test]
    fn unigram_entropy_of_uniform_tokens_is_log_n() {
        let h = Corpus::unigram_entropy(&[0, 1, 2, 3, 0, 1, 2, 3]);
        assert!((h - 4f64.ln()).abs() < 1e-12);
        assert_eq!(Corpus::unigram_entropy(&[5, 5, 5]), 0.0);
    }
}
