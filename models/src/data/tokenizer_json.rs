//! `JsonTokenizer`: a Hugging Face `tokenizer.json` (GPT-2's, Llama 3's, Qwen2's byte-level
//! BPE with its pre-tokenizer regexes, normalizers and added tokens) through the `tokenizers`
//! crate, as transformers' fast tokenizers read it. Text encodes without the post-processor's
//! special tokens (no BOS is prepended) while added tokens written in the text are matched, as
//! the Python package's `encode(text, add_special_tokens=False)` does; padding and truncation
//! a file may configure are switched off (no id is lost or invented), and so is BPE dropout
//! (the same text gives the same ids on every rank and run); a byte-level BPE that would drop
//! bytes it has no token for is refused. Its identity is the SHA-256 of the file. Its
//! end-of-text token (the document separator of `prepare`, the empty prompt of generation) is
//! the `eos_token` of a `tokenizer_config.json` beside it, else the first special added token
//! among `END_OF_TEXT_NAMES`, else none: none is invented.

use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::error::DataError;

/// The file a directory given as a tokenizer holds.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// The file beside it that may name its special tokens.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// The largest tokenizer file read (bytes; Llama 3's is about 9 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;
/// Special added tokens taken as the end of a text when no tokenizer_config.json names one,
/// in order of preference.
pub const END_OF_TEXT_NAMES: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];

/// A tokenizer.json, loaded.
pub struct JsonTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    sha256: String,
    vocab: usize,
    end_of_text: Option<EndOfText>,
}

/// The token separating documents, and where it was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndOfText {
    pub id: u32,
    pub content: String,
    /// `tokenizer_config.json`'s `eos_token`, or the added tokens.
    pub from: &'static str,
}

impl std::fmt::Debug for JsonTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonTokenizer")
            .field("path", &self.path)
            .field("sha256", &self.sha256)
            .field("vocab", &self.vocab)
            .field("end_of_text", &self.end_of_text)
            .finish()
    }
}

fn read_regular(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read it: {e}"))?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(limit + 1).read_to_end(&mut bytes))
        .map_err(|e| format!("cannot read it: {e}"))?;
    if bytes.len() as u64 > limit {
        return Err(format!("larger than the {limit}-byte limit"));
    }
    Ok(bytes)
}

/// `eos_token` of a tokenizer_config.json: a string, an object with `content`, or null.
fn configured_eos(config: &serde_json::Value) -> Result<Option<String>, String> {
    match config.get("eos_token") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => match v.get("content") {
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(format!(
                "its eos_token is {v}, neither a string nor an object with a string content"
            )),
        },
    }
}

/// Switches off BPE dropout (random merges at each encoding: ids would differ from run to run
/// and from rank to rank), and refuses a byte-level BPE without an unknown token or byte
/// fallback whose vocabulary lacks one of the 256 byte characters: the library drops such a
/// byte from the ids without a word, losing text.
fn deterministic_and_whole(inner: &mut tokenizers::Tokenizer) -> Result<(), String> {
    use tokenizers::models::ModelWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    let ModelWrapper::BPE(bpe) = inner.get_model() else {
        return Ok(());
    };
    if bpe.dropout.is_some() {
        let mut b = bpe.clone();
        b.dropout = None;
        inner.with_model(b);
    }
    let ModelWrapper::BPE(bpe) = inner.get_model() else {
        return Ok(());
    };
    if bpe.unk_token.is_some() || bpe.byte_fallback {
        return Ok(());
    }
    let pre = serde_json::to_value(inner.get_pre_tokenizer())
        .map_err(|e| format!("its pre-tokenizer does not serialize: {e}"))?;
    if !names_byte_level(&pre) {
        return Ok(());
    }
    let vocab = bpe.get_vocab();
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort_unstable();
    let missing: Vec<char> = alphabet
        .into_iter()
        .filter(|c| !vocab.contains_key(&c.to_string()))
        .collect();
    match missing.first() {
        None => Ok(()),
        Some(c) => Err(format!(
            "a byte-level BPE without unk_token or byte_fallback whose vocabulary lacks {} of \
             the 256 byte characters (the first {c:?}, U+{:04X}): text holding those bytes \
             would lose them",
            missing.len(),
            u32::from(*c)
        )),
    }
}

/// Checks what the tokenizers library would panic on instead of refusing, before it reads the
/// file: the text must be JSON (the library's decoder reader `expect`s a readable value, so a
/// truncated file panics there), and the merges of a BPE model must each name two tokens of the
/// vocabulary whose concatenation (the second without the continuing-subword prefix) is one too
/// (the library copies each concatenation into a buffer as long as the longest vocabulary entry
/// before looking it up, so a merge making a longer token panics). Other shapes are left to the
/// library's own errors.
fn library_safe(bytes: &[u8]) -> Result<(), String> {
    use serde_json::Value;
    let doc = serde_json::from_slice::<Value>(bytes)
        .map_err(|e| format!("not a tokenizer.json the tokenizers library reads: not JSON: {e}"))?;
    let model = &doc["model"];
    let (Some(vocab), Some(merges)) = (model["vocab"].as_object(), model["merges"].as_array())
    else {
        return Ok(());
    };
    if !matches!(model.get("type"), None | Some(Value::String(_)))
        || model["type"].as_str().is_some_and(|t| t != "BPE")
    {
        return Ok(());
    }
    let prefix = model["continuing_subword_prefix"].as_str().unwrap_or("");
    for (rank, merge) in merges.iter().enumerate() {
        let (a, b) = match merge {
            Value::String(line) if line.starts_with("#version") => continue,
            Value::String(line) => match line.split(' ').collect::<Vec<_>>()[..] {
                [a, b] => (a, b),
                _ => continue,
            },
            Value::Array(pair) => match &pair[..] {
                [Value::String(a), Value::String(b)] => (a.as_str(), b.as_str()),
                _ => continue,
            },
            _ => continue,
        };
        let Some(rest) = b.get(prefix.len()..) else {
            return Err(format!(
                "its BPE merge {rank} ({a:?}, {b:?}): {b:?} does not hold the continuing-subword \
                 prefix {prefix:?}'s length in whole characters"
            ));
        };
        for part in [a, b] {
            if !vocab.contains_key(part) {
                return Err(format!(
                    "its BPE merge {rank} ({a:?}, {b:?}) names {part:?}, which is not in the vocabulary"
                ));
            }
        }
        let joined = format!("{a}{rest}");
        if !vocab.contains_key(&joined) {
            return Err(format!(
                "its BPE merge {rank} ({a:?}, {b:?}) makes {joined:?}, which is not in the vocabulary"
            ));
        }
    }
    Ok(())
}

/// Whether a serialized pre-tokenizer is, or holds, a `ByteLevel` one.
fn names_byte_level(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Object(m) => {
            m.get("type").and_then(|t| t.as_str()) == Some("ByteLevel")
                || m.values().any(names_byte_level)
        }
        serde_json::Value::Array(a) => a.iter().any(names_byte_level),
        _ => false,
    }
}

impl JsonTokenizer {
    /// The tokenizer at `path`: a tokenizer.json, or a directory holding one.
    pub fn open(path: &Path) -> Result<JsonTokenizer, DataError> {
        let file = if path.is_dir() {
            path.join(TOKENIZER_FILE)
        } else {
            path.to_path_buf()
        };
        let bad = |detail: String| DataError::TokenizerFile {
            path: file.clone(),
            detail,
        };
        if path.is_dir() && !file.exists() {
            return Err(DataError::TokenizerFile {
                path: path.to_path_buf(),
                detail: format!("a directory without a {TOKENIZER_FILE}"),
            });
        }
        let bytes = read_regular(&file, MAX_TOKENIZER_BYTES).map_err(&bad)?;
        let sha256 = format!("{:x}", Sha256::digest(&bytes));
        library_safe(&bytes).map_err(&bad)?;
        let mut inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            bad(format!(
                "not a tokenizer.json the tokenizers library reads: {e}"
            ))
        })?;
        inner
            .with_truncation(None)
            .map_err(|e| bad(format!("its truncation cannot be switched off: {e}")))?;
        inner.with_padding(None);
        deterministic_and_whole(&mut inner).map_err(&bad)?;
        let vocab = inner
            .get_vocab(true)
            .values()
            .max()
            .map(|&m| m as usize + 1)
            .ok_or_else(|| bad("its vocabulary is empty".into()))?;
        let mut t = JsonTokenizer {
            inner,
            path: file.clone(),
            sha256,
            vocab,
            end_of_text: None,
        };
        t.end_of_text = t.find_end_of_text()?;
        Ok(t)
    }

    /// See the module docs.
    fn find_end_of_text(&self) -> Result<Option<EndOfText>, DataError> {
        let config = self
            .path
            .parent()
            .map(|d| d.join(TOKENIZER_CONFIG_FILE))
            .filter(|c| c.exists());
        if let Some(config) = config {
            let bad = |detail: String| DataError::TokenizerFile {
                path: config.clone(),
                detail,
            };
            let bytes = read_regular(&config, MAX_TOKENIZER_BYTES).map_err(&bad)?;
            let value: serde_json::Value =
                serde_json::from_slice(&bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
            if let Some(content) = configured_eos(&value).map_err(&bad)? {
                let id = self.inner.token_to_id(&content).ok_or_else(|| {
                    bad(format!(
                        "its eos_token {content:?} is no token of {}",
                        self.path.display()
                    ))
                })?;
                return Ok(Some(EndOfText {
                    id,
                    content,
                    from: "tokenizer_config.json's eos_token",
                }));
            }
        }
        let added = self.inner.get_added_tokens_decoder();
        Ok(END_OF_TEXT_NAMES.iter().find_map(|name| {
            added
                .iter()
                .filter(|(_, t)| t.special && t.content == *name)
                .map(|(&id, t)| EndOfText {
                    id,
                    content: t.content.clone(),
                    from: "the added special tokens",
                })
                .min_by_key(|e| e.id)
        }))
    }

    /// The tokenizer.json read.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Hex SHA-256 of the file.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }
    /// One more than its largest id (ids of the model and of added tokens).
    pub fn vocab(&self) -> usize {
        self.vocab
    }
    /// Its end-of-text token, if it has one (see the module docs).
    pub fn end_of_text(&self) -> Option<&EndOfText> {
        self.end_of_text.as_ref()
    }

    fn err(&self, detail: String) -> DataError {
        DataError::TokenizerFile {
            path: self.path.clone(),
            detail,
        }
    }

    /// The ids of `text` (see the module docs).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        // Offsets are not needed: `encode_fast` gives the same ids without them.
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| self.err(format!("encoding {} bytes of text: {e}", text.len())))
    }

    /// The text of `ids`, special tokens included; an id the tokenizer does not hold (a
    /// model's table may be larger than its tokenizer) shows as `<id>`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        let mut out = String::new();
        let mut run: Vec<u32> = Vec::new();
        let flush = |run: &mut Vec<u32>, out: &mut String| -> Result<(), DataError> {
            if !run.is_empty() {
                let text = self
                    .inner
                    .decode(run, false)
                    .map_err(|e| self.err(format!("decoding {} ids: {e}", run.len())))?;
                out.push_str(&text);
                run.clear();
            }
            Ok(())
        };
        for &id in ids {
            if self.inner.id_to_token(id).is_some() {
                run.push(id);
            } else {
                flush(&mut run, &mut out)?;
                out.push_str(&format!("<{id}>"));
            }
        }
        flush(&mut run, &mut out)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eos_tokens_of_a_config_are_strings_objects_or_null() {
        let v = serde_json::json!({"eos_token": "<|end_of_text|>"});
        assert_eq!(configured_eos(&v), Ok(Some("<|end_of_text|>".into())));
        let v = serde_json::json!({"eos_token": {"content": "<|im_end|>", "special": true}});
        assert_eq!(configured_eos(&v), Ok(Some("<|im_end|>".into())));
        assert_eq!(
            configured_eos(&serde_json::json!({"eos_token": null})),
            Ok(None)
        );
        assert_eq!(configured_eos(&serde_json::json!({})), Ok(None));
        assert!(configured_eos(&serde_json::json!({"eos_token": 7})).is_err());
    }
}
