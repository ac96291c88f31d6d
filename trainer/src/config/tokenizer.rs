//! `--tokenizer` (of `train` and `train prepare` alike, default `bytes`): a built-in tokenizer
//! by name (`bytes`, `gpt2`) or a Hugging Face tokenizer.json (a path to the file or to a
//! directory holding one; a name wins over a file of that name, which `./bytes` reaches).
//! Written as one string on the command line and in job files; opened (`open`) before any
//! rank starts, so every rank refuses a bad file alike.

use std::path::PathBuf;
use std::str::FromStr;

use oxiflow_models::data::Tokenizer;
use serde::{Deserialize, Serialize};

use crate::error::TrainError;

/// The tokenizer of text data and samples.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum TokenizerArg {
    /// One token per byte (vocabulary 256).
    #[default]
    Bytes,
    /// GPT-2's BPE (vocabulary 50257; built in, nothing is downloaded).
    Gpt2,
    /// A tokenizer.json, or a directory holding one.
    File(PathBuf),
}

impl FromStr for TokenizerArg {
    type Err = String;
    fn from_str(s: &str) -> Result<TokenizerArg, String> {
        match s {
            "bytes" => Ok(TokenizerArg::Bytes),
            "gpt2" => Ok(TokenizerArg::Gpt2),
            "" => Err(
                "empty: give bytes, gpt2, or the path of a tokenizer.json (or of a \
                       directory holding one)"
                    .into(),
            ),
            path => Ok(TokenizerArg::File(PathBuf::from(path))),
        }
    }
}

impl TryFrom<String> for TokenizerArg {
    type Error = String;
    fn try_from(s: String) -> Result<TokenizerArg, String> {
        s.parse()
    }
}

impl From<TokenizerArg> for String {
    fn from(t: TokenizerArg) -> String {
        t.to_string()
    }
}

impl std::fmt::Display for TokenizerArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenizerArg::Bytes => f.write_str("bytes"),
            TokenizerArg::Gpt2 => f.write_str("gpt2"),
            TokenizerArg::File(p) => write!(f, "{}", p.display()),
        }
    }
}

impl TokenizerArg {
    /// The tokenizer it names, loaded (a file that cannot be used is an error naming
    /// `--tokenizer`, the file and why).
    pub fn open(&self) -> Result<Tokenizer, TrainError> {
        match self {
            TokenizerArg::Bytes => Ok(Tokenizer::Bytes),
            TokenizerArg::Gpt2 => Ok(Tokenizer::Gpt2),
            TokenizerArg::File(p) => Tokenizer::from_file(p).map_err(|e| TrainError::Config {
                detail: format!(
                    "--tokenizer {}: not bytes or gpt2, and not a usable tokenizer.json: {e}",
                    p.display()
                ),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_paths_parse_and_print_back() {
        for s in ["bytes", "gpt2", "models/llama/tokenizer.json", "./bytes"] {
            let t: TokenizerArg = s.parse().unwrap();
            assert_eq!(t.to_string(), s);
        }
        assert_eq!("gpt2".parse(), Ok(TokenizerArg::Gpt2));
        assert!("".parse::<TokenizerArg>().is_err());
        let e = TokenizerArg::File("/nonexistent/tok.json".into())
            .open()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--tokenizer /nonexistent/tok.json") && e.contains("cannot read it"),
            "{e}"
        );
    }
}
