//! Tokenizers: `ByteTokenizer` (one token per byte, vocabulary 256: any text encodes and every
//! id sequence decodes) and `Gpt2Tokenizer` (GPT-2's byte-level BPE, vocabulary 50257, through
//! `tiktoken-rs`, whose merge table is compiled into the crate: nothing is downloaded), and
//! `Tokenizer`, the choice between them.

use std::sync::OnceLock;

use tiktoken_rs::CoreBPE;

use super::error::DataError;

/// The byte-level tokenizer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Number of token ids.
    pub const VOCAB: usize = 256;

    /// The ids of `text`'s bytes.
    pub fn encode(&self, text: &str) -> Vec<u16> {
        text.bytes().map(u16::from).collect()
    }

    /// The text of `ids`; ids above 255 (from a pre-tokenized corpus with a larger vocabulary)
    /// print as `<id>`.
    pub fn decode(&self, ids: &[u16]) -> String {
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
    pub const END_OF_TEXT: u16 = 50256;

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
    pub fn encode(&self, text: &str) -> Result<Vec<u16>, DataError> {
        let ids = Self::bpe()?.encode_ordinary(text);
        ids.into_iter()
            .map(|id| {
                u16::try_from(id).map_err(|_| DataError::Tokenizer {
                    name: "gpt2",
                    detail: format!("id {id} does not fit 16 bits"),
                })
            })
            .collect()
    }

    /// The text of `ids` (bytes that are not UTF-8 show as replacement characters; ids outside
    /// the vocabulary as `<id>`).
    pub fn decode(&self, ids: &[u16]) -> Result<String, DataError> {
        let bpe = Self::bpe()?;
        let mut out = Vec::new();
        for &id in ids {
            if usize::from(id) >= Self::VOCAB {
                out.extend(format!("<{id}>").bytes());
                continue;
            }
            match bpe.decode_bytes(&[u32::from(id)]) {
                Ok(b) => out.extend(b),
                Err(_) => out.extend(format!("<{id}>").bytes()),
            }
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }
}

/// The tokenizer of a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Tokenizer {
    #[default]
    Bytes,
    Gpt2,
}

impl Tokenizer {
    /// Number of token ids.
    pub fn vocab(self) -> usize {
        match self {
            Tokenizer::Bytes => ByteTokenizer::VOCAB,
            Tokenizer::Gpt2 => Gpt2Tokenizer::VOCAB,
        }
    }
    /// The name used on the command line (`bytes`, `gpt2`).
    pub fn name(self) -> &'static str {
        match self {
            Tokenizer::Bytes => "bytes",
            Tokenizer::Gpt2 => "gpt2",
        }
    }
    /// The ids of `text`.
    pub fn encode(self, text: &str) -> Result<Vec<u16>, DataError> {
        match self {
            Tokenizer::Bytes => Ok(ByteTokenizer.encode(text)),
            Tokenizer::Gpt2 => Gpt2Tokenizer.encode(text),
        }
    }
    /// The text of `ids`.
    pub fn decode(self, ids: &[u16]) -> Result<String, DataError> {
        match self {
            Tokenizer::Bytes => Ok(ByteTokenizer.decode(ids)),
            Tokenizer::Gpt2 => Gpt2Tokenizer.decode(ids),
        }
    }
    /// The id separating documents, if the tokenizer has one.
    pub fn end_of_text(self) -> Option<u16> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::Gpt2 => Some(Gpt2Tokenizer::END_OF_TEXT),
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
