//! Hugging Face tokenizer.json files through the `tokenizers` crate against the Python
//! package's ids: the fixtures under tests/fixtures/tokenizers (made by
//! scripts/tokenizer_fixture.py: GPT-2-, Llama-3- and Qwen2-style byte-level BPEs, and one whose
//! ids exceed 16 bits) encode sample.txt to exactly the ids reference.json holds, decode them to
//! the text the package decodes, and give the text back where the tokenizer is lossless. Their
//! end-of-text tokens come from tokenizer_config.json or the added tokens; bad files are errors
//! naming the file.

use std::path::{Path, PathBuf};

use oxiflow_models::data::{Corpus, DataError, Tokenizer};
use serde_json::Value;
use sha2::{Digest, Sha256};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizers")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixtures().join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap() as u32)
        .collect()
}

const NAMES: [&str; 4] = ["gpt2-style", "llama3-style", "qwen2-style", "wide"];

#[test]
fn ids_equal_the_python_packages() {
    let sample = std::fs::read_to_string(fixtures().join("sample.txt")).unwrap();
    let reference = reference();
    for name in NAMES {
        let r = &reference[name];
        let t = Tokenizer::from_file(&fixtures().join(name)).unwrap();
        assert_eq!(
            t.vocab() as u64,
            r["vocab_size"].as_u64().unwrap(),
            "{name}"
        );
        let want = ids(&r["ids"]);
        let got = t.encode(&sample).unwrap();
        assert_eq!(got, want, "{name}: the ids of sample.txt");
        let text = t.decode(&got).unwrap();
        assert_eq!(text, r["decoded"].as_str().unwrap(), "{name}: decode");
        if r["lossless"].as_bool().unwrap() {
            assert_eq!(text, sample, "{name}: decode(encode(x)) == x");
        } else {
            assert_ne!(text, sample, "{name}: the reference says it is lossy");
        }
        for (s, want) in r["short"].as_object().unwrap() {
            assert_eq!(t.encode(s).unwrap(), ids(want), "{name}: {s:?}");
        }
        // Through a corpus, as `train --data sample.txt --tokenizer DIR` reads it.
        let c = Corpus::from_path(&fixtures().join("sample.txt"), &t).unwrap();
        assert_eq!(&c.tokens()[..], &want[..], "{name}: corpus");
        assert_eq!(c.vocab(), t.vocab());
    }
    let wide = ids(&reference["wide"]["ids"]);
    assert!(
        wide.iter().any(|&i| i > 65535),
        "the wide fixture needs u32 ids"
    );
}

#[test]
fn end_of_text_comes_from_the_config_or_the_added_tokens() {
    let eot = |name: &str| {
        let t = Tokenizer::from_file(&fixtures().join(name)).unwrap();
        let id = t.end_of_text().unwrap();
        (t.decode(&[id]).unwrap(), t.describe_end_of_text().unwrap())
    };
    let (text, how) = eot("gpt2-style");
    assert_eq!(text, "<|endoftext|>");
    assert!(how.contains("added special tokens"), "{how}");
    let (text, how) = eot("llama3-style");
    assert_eq!(text, "<|end_of_text|>");
    assert!(how.contains("tokenizer_config.json's eos_token"), "{how}");
    assert_eq!(eot("qwen2-style").0, "<|im_end|>");
    let wide = Tokenizer::from_file(&fixtures().join("wide/tokenizer.json")).unwrap();
    assert_eq!(wide.end_of_text(), Some(70_000));
}

#[test]
fn identity_is_the_files_hash_and_unknown_ids_show_by_number() {
    let file = fixtures().join("gpt2-style/tokenizer.json");
    let t = Tokenizer::from_file(&file).unwrap();
    let hash = format!("{:x}", Sha256::digest(std::fs::read(&file).unwrap()));
    assert_eq!(t.identity(), format!("sha256:{hash}"));
    // The same file through its directory is the same tokenizer.
    assert_eq!(Tokenizer::from_file(file.parent().unwrap()).unwrap(), t);
    assert_ne!(
        Tokenizer::from_file(&fixtures().join("llama3-style")).unwrap(),
        t
    );
    let hello = t.encode("hello").unwrap();
    let mut with = hello.clone();
    with.push(600);
    with.extend(&hello);
    assert_eq!(t.decode(&with).unwrap(), "hello<600>hello");
    let wide = Tokenizer::from_file(&fixtures().join("wide")).unwrap();
    assert_eq!(wide.decode(&[1000, 70_000]).unwrap(), "<1000><|endoftext|>");
}

#[test]
fn bad_tokenizer_files_name_the_file() {
    let d = std::env::temp_dir().join(format!("oxiflow-tokjson-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let err = |p: &Path| match Tokenizer::from_file(p) {
        Err(e @ DataError::TokenizerFile { .. }) => e.to_string(),
        other => panic!("{p:?}: {other:?}"),
    };
    // The error of the folder after writing `bytes` to its file `name`.
    let err_with = |name: &str, bytes: &[u8]| {
        std::fs::write(d.join(name), bytes).unwrap();
        err(&d)
    };
    let e = err(&d);
    assert!(e.contains("a directory without a tokenizer.json"), "{e}");
    let e = err_with("tokenizer.json", b"{\"version\": \"1.0\", \"model\": ");
    assert!(
        e.contains(&format!("{}", d.join("tokenizer.json").display()))
            && e.contains("not JSON: EOF while parsing"),
        "{e}"
    );
    let e = err_with("tokenizer.json", b"{\"version\": \"1.0\", \"model\": 3}");
    assert!(
        e.contains("not a tokenizer.json the tokenizers library reads"),
        "{e}"
    );
    let good = std::fs::read(fixtures().join("llama3-style/tokenizer.json")).unwrap();
    std::fs::write(d.join("tokenizer.json"), &good).unwrap();
    let e = err_with("tokenizer_config.json", b"{\"eos_token\": \"<|nope|>\"}");
    assert!(
        e.contains("tokenizer_config.json") && e.contains("eos_token \"<|nope|>\" is no token"),
        "{e}"
    );
    assert!(err_with("tokenizer_config.json", b"not json").contains("not JSON"));
    // No config: its added <|end_of_text|> is the end of a text.
    std::fs::remove_file(d.join("tokenizer_config.json")).unwrap();
    let t = Tokenizer::from_file(&d).unwrap();
    assert_eq!(
        t.decode(&[t.end_of_text().unwrap()]).unwrap(),
        "<|end_of_text|>"
    );
    // Without that added token either, none is invented.
    let mut doc: Value = serde_json::from_slice(&good).unwrap();
    doc["added_tokens"]
        .as_array_mut()
        .unwrap()
        .retain(|a| a["content"] != "<|end_of_text|>");
    std::fs::write(d.join("tokenizer.json"), doc.to_string()).unwrap();
    let t = Tokenizer::from_file(&d).unwrap();
    assert_eq!((t.end_of_text(), t.describe_end_of_text()), (None, None));
    let e = err(&d.join("missing.json"));
    assert!(
        e.contains("missing.json") && e.contains("cannot read it"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// BPE dropout a file configures is switched off: the ids stay the Python package's
/// deterministic ones, run after run. A byte-level BPE lacking a byte's character (and without
/// unk_token or byte_fallback) would drop that byte from the ids: refused, naming it; with an
/// unknown token the byte becomes that token, and the file is accepted.
#[test]
fn dropout_is_off_and_a_bpe_that_would_drop_bytes_is_refused() {
    let d = std::env::temp_dir().join(format!("oxiflow-tokdrop-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let sample = std::fs::read_to_string(fixtures().join("sample.txt")).unwrap();
    let want = ids(&reference()["gpt2-style"]["ids"]);
    let good = std::fs::read(fixtures().join("gpt2-style/tokenizer.json")).unwrap();
    let mut doc: Value = serde_json::from_slice(&good).unwrap();
    doc["model"]["dropout"] = serde_json::json!(0.9);
    let f = d.join("tokenizer.json");
    std::fs::write(&f, doc.to_string()).unwrap();
    let t = Tokenizer::from_file(&f).unwrap();
    for _ in 0..5 {
        assert_eq!(t.encode(&sample).unwrap(), want);
    }
    // Byte 0's character, U+0100, taken out of the vocabulary (no merge uses it).
    let mut doc: Value = serde_json::from_slice(&good).unwrap();
    let vocab = doc["model"]["vocab"].as_object_mut().unwrap();
    assert!(vocab.remove("\u{100}").is_some());
    std::fs::write(&f, doc.to_string()).unwrap();
    let e = Tokenizer::from_file(&f).unwrap_err().to_string();
    assert!(
        e.contains(&f.display().to_string())
            && e.contains("lacks 1 of the 256 byte characters (the first 'Ā', U+0100)"),
        "{e}"
    );
    doc["model"]["unk_token"] = serde_json::json!("<|endoftext|>");
    std::fs::write(&f, doc.to_string()).unwrap();
    let t = Tokenizer::from_file(&f).unwrap();
    assert_eq!(t.encode("a\0b").unwrap().len(), 3);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_merge_whose_product_left_the_vocabulary_is_refused() {
    // The library sizes its merge buffer by the longest vocabulary entry; taking that entry out
    // made a merge's product longer than the buffer (a panic inside the library before this
    // check).
    let d = std::env::temp_dir().join(format!("oxiflow-tok-merge-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let good = std::fs::read(fixtures().join("gpt2-style/tokenizer.json")).unwrap();
    let mut doc: Value = serde_json::from_slice(&good).unwrap();
    let vocab = doc["model"]["vocab"].as_object_mut().unwrap();
    let longest = vocab.keys().max_by_key(|k| k.len()).unwrap().clone();
    vocab.remove(&longest);
    let f = d.join("tokenizer.json");
    std::fs::write(&f, doc.to_string()).unwrap();
    let e = Tokenizer::from_file(&f).unwrap_err().to_string();
    assert!(
        e.contains(&f.display().to_string())
            && e.contains(&format!("{longest:?}, which is not in the vocabulary")),
        "{e}"
    );
    doc["model"]["continuing_subword_prefix"] = serde_json::json!("a-long-prefix");
    std::fs::write(&f, doc.to_string()).unwrap();
    let e = Tokenizer::from_file(&f).unwrap_err().to_string();
    assert!(e.contains("continuing-subword prefix"), "{e}");
    let _ = std::fs::remove_dir_all(&d);
}

mod hostile {
    //! Edited tokenizer.json files (ids out of range or repeated, merges of unknown tokens,
    //! wrong types, a truncated file) load as an error or as a tokenizer that encodes and
    //! decodes without panicking.

    use super::*;
    use proptest::prelude::*;

    fn edit(doc: &mut Value, which: u8, n: u64) {
        let vocab = doc["model"]["vocab"].as_object_mut().unwrap();
        let keys: Vec<String> = vocab.keys().cloned().collect();
        let key = &keys[n as usize % keys.len()];
        match which % 10 {
            0 => vocab[key] = serde_json::json!(n),
            1 => vocab[key] = serde_json::json!(u32::MAX),
            2 => vocab[key] = serde_json::json!(-1),
            3 => {
                vocab.remove(key);
            }
            4 => doc["model"]["merges"][0] = serde_json::json!(["nope", "x"]),
            5 => doc["added_tokens"][0]["id"] = serde_json::json!(n),
            6 => doc["added_tokens"][0]["content"] = serde_json::json!(""),
            7 => {
                doc["pre_tokenizer"] = serde_json::json!({"type": "Split", "pattern": {"Regex": "(("}, "behavior": "Isolated", "invert": false})
            }
            8 => doc["model"]["type"] = serde_json::json!("WordPiece"),
            _ => doc["decoder"] = serde_json::json!(n),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn edited_files_never_panic(edits in proptest::collection::vec((0u8..10, 0u64..2000), 1..4), cut in 0usize..40_000) {
            let src = std::fs::read(fixtures().join("gpt2-style/tokenizer.json")).unwrap();
            let mut doc: Value = serde_json::from_slice(&src).unwrap();
            for (w, n) in &edits {
                edit(&mut doc, *w, *n);
            }
            let mut bytes = doc.to_string().into_bytes();
            if cut < bytes.len() && cut % 3 == 0 {
                bytes.truncate(cut);
            }
            let d = std::env::temp_dir().join(format!("oxiflow-tokfuzz-{}", std::process::id()));
            std::fs::create_dir_all(&d).unwrap();
            let f = d.join("tokenizer.json");
            std::fs::write(&f, &bytes).unwrap();
            if let Ok(t) = Tokenizer::from_file(&f) {
                let text = "Hello world, it's 2024! <|endoftext|> café 🦀";
                if let Ok(ids) = t.encode(text) {
                    let _ = t.decode(&ids);
                }
                let _ = t.decode(&[0, 1, 5000, u32::MAX]);
            }
        }
    }
}
