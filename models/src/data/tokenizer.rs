//! Tokenizers: `ByteTokenizer` (one token per byte, vocabulary 256: any text encodes and every
//! id sequence decodes), `Gpt2Tokenizer` (GPT-2's byte-level BPE, vocabulary 50257, through
//! `tiktoken-rs`, whose merge table is compiled into the crate: nothing is downloaded), a
//! Hugging Face tokenizer.json (`JsonTokenizer`), and `Tokenizer`, the choice between them.
//! Token ids are u32 (Llama 3's and Qwen2's vocabularies exceed 16 bits).

use std::path::Path;
use std::sync::{Arc, OnceLock};

use tiktoken_rs::CoreBPE;

use super::error::DataError;
use super::tokenizer_json::JsonTokenizer;

/// The byte-level tokenizer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Number of token ids.
    pub const VOCAB: usize = 256;

    /// The ids of `text`'s bytes.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    /// The text of `ids`; ids above 255 (from a pre-tokenized corpus with a larger vocabulary)
    /// print as `<id>`.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut out = String::new();
        let mut bytes = Vec::new();
        for &id in ids {
            match u8::try_from(id) {
                Ok(b) => bytes.push(b),
                Err(_) => {
                    out.push_str(&String::from_utf8_lossy(&bytes));
                    bytes.clear();
                    out.push_str(&format!("<{id}>"));
                }
            }
        }
        out.push_str(&String::from_utf8_lossy(&bytes));
        out
    }
}

/// GPT-2's BPE (tiktoken's `gpt2` / `r50k_base` encoding). Text encodes as ordinary text: the
/// characters of `<|endoftext|>` in a file are text, not the special token, which only
/// [`Gpt2Tokenizer::END_OF_TEXT`] is (`prepare` puts it between documents).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gpt2Tokenizer;

impl Gpt2Tokenizer {
    /// Number of token ids (50,000 merges, 256 bytes, `<|endoftext|>`).
    pub const VOCAB: usize = 50257;
    /// The id of `<|endoftext|>`.
    pub const END_OF_TEXT: u32 = 50256;

    fn bpe() -> Result<&'static CoreBPE, DataError> {
        static BPE: OnceLock<Result<CoreBPE, String>> = OnceLock::new();
        BPE.get_or_init(|| tiktoken_rs::r50k_base().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| DataError::Tokenizer {
                name: "gpt2",
                detail: format!("the built-in merge table does not load: {e}"),
            })
    }

    /// The ids of `text`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        Ok(Self::bpe()?.encode_ordinary(text))
    }

    /// The text of `ids` (bytes that are not UTF-8 show as replacement characters; ids outside
    /// the vocabulary as `<id>`).
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        let bpe = Self::bpe()?;
        let mut out = Vec::new();
        for &id in ids {
            if id as usize >= Self::VOCAB {
                out.extend(format!("<{id}>").bytes());
                continue;
            }
            match bpe.decode_bytes(&[id]) {
                Ok(b) => out.extend(b),
                Err(_) => out.extend(format!("<{id}>").bytes()),
            }
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }
}

/// The tokenizer of a run.
#[derive(Clone, Debug, Default)]
pub enum Tokenizer {
    #[default]
    Bytes,
    Gpt2,
    /// A tokenizer.json.
    Json(Arc<JsonTokenizer>),
}

impl PartialEq for Tokenizer {
    fn eq(&self, other: &Tokenizer) -> bool {
        self.identity() == other.identity()
    }
}

impl Eq for Tokenizer {}

impl std::fmt::Display for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokenizer::Json(t) => write!(f, "{}", t.path().display()),
            _ => f.write_str(self.builtin_name().unwrap_or_default()),
        }
    }
}

impl Tokenizer {
    /// The tokenizer.json at `path` (a file, or a directory holding `tokenizer.json`).
    pub fn from_file(path: &Path) -> Result<Tokenizer, DataError> {
        Ok(Tokenizer::Json(Arc::new(JsonTokenizer::open(path)?)))
    }

    /// Number of token ids.
    pub fn vocab(&self) -> usize {
        match self {
            Tokenizer::Bytes => ByteTokenizer::VOCAB,
            Tokenizer::Gpt2 => Gpt2Tokenizer::VOCAB,
            Tokenizer::Json(t) => t.vocab(),
        }
    }
    /// The name of a built-in tokenizer on the command line (`bytes`, `gpt2`).
    pub fn builtin_name(&self) -> Option<&'static str> {
        match self {
            Tokenizer::Bytes => Some("bytes"),
            Tokenizer::Gpt2 => Some("gpt2"),
            Tokenizer::Json(_) => None,
        }
    }
    /// What a checkpoint records of it: a built-in one's name, a file's `sha256:HEX` (the
    /// same tokenizer wherever the file lies).
    pub fn identity(&self) -> String {
        match self {
            Tokenizer::Json(t) => format!("sha256:{}", t.sha256()),
            _ => self.to_string(),
        }
    }
    /// The ids of `text`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        match self {
            Tokenizer::Bytes => Ok(ByteTokenizer.encode(text)),
            Tokenizer::Gpt2 => Gpt2Tokenizer.encode(text),
            Tokenizer::Json(t) => t.encode(text),
        }
    }
    /// The ids of a file's `bytes`: each byte for the byte tokenizer, else the text they hold
    /// (bytes that are not UTF-8 read as replacement characters).
    pub fn encode_bytes(&self, bytes: &[u8]) -> Result<Vec<u32>, DataError> {
        match self {
            Tokenizer::Bytes => Ok(bytes.iter().map(|&b| u32::from(b)).collect()),
            _ => self.encode(&String::from_utf8_lossy(bytes)),
        }
    }
    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        match self {
            Tokenizer::Bytes => Ok(ByteTokenizer.decode(ids)),
            Tokenizer::Gpt2 => Gpt2Tokenizer.decode(ids),
            Tokenizer::Json(t) => t.decode(ids),
        }
    }
    /// The id separating documents, if the tokenizer has one.
    pub fn end_of_text(&self) -> Option<u32> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::Gpt2 => Some(Gpt2Tokenizer::END_OF_TEXT),
            Tokenizer::Json(t) => t.end_of_text().map(|e| e.id),
        }
    }
    /// For people: `<|endoftext|> (id 50256, GPT-2's)` or where a file's came from, or None.
    pub fn describe_end_of_text(&self) -> Option<String> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::Gpt2 => Some(format!("<|endoftext|> (id {})", Gpt2Tokenizer::END_OF_TEXT)),
            Tokenizer::Json(t) => t
                .end_of_text()
                .map(|e| format!("{} (id {}, from {})", e.content, e.id, e.from)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn decode_inverts_encode(s in ".{0,64}") {
            let t = ByteTokenizer;
            prop_assert_eq!(t.decode(&t.encode(&s)), s.clone());
            let g = Gpt2Tokenizer;
            prop_assert_eq!(g.decode(&g.encode(&s).unwrap()).unwrap(), s);
        }
    }

    #[test]
    fn large_ids_are_shown_by_number() {
        assert_eq!(ByteTokenizer.decode(&[104, 300, 105]), "h<300>i");
        assert_eq!(
            Gpt2Tokenizer.decode(&[31373, 60000]).unwrap(),
            "hello<60000>"
        );
    }
}
