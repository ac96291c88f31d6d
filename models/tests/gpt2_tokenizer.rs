//! GPT-2's BPE through tiktoken-rs, against an independent reference: the ids OpenAI's tiktoken
//! test suite asserts for its `gpt2` encoding (tests/test_encoding.py: `test_simple`,
//! `test_simple_repeated`, `test_encode_empty`), and encode/decode round trips over the README's
//! corpus (the license texts, or the generated fallback), which needs no download.

use oxiflow_models::data::{generated_text, Corpus, Gpt2Tokenizer, Tokenizer};

/// (text, ids) from tiktoken's tests for the `gpt2` encoding.
const REFERENCE: &[(&str, &[u32])] = &[
    ("hello world", &[31373, 995]),
    ("", &[]),
    ("0", &[15]),
    ("00", &[405]),
    ("000", &[830]),
    ("0000", &[2388]),
    ("00000", &[20483]),
    ("000000", &[10535]),
    ("0000000", &[24598]),
    ("00000000", &[8269]),
    ("000000000", &[10535, 830]),
    ("0000000000", &[8269, 405]),
    ("00000000000", &[8269, 830]),
    ("000000000000", &[8269, 2388]),
    ("0000000000000", &[8269, 20483]),
    ("00000000000000", &[8269, 10535]),
    ("000000000000000", &[8269, 24598]),
    ("0000000000000000", &[25645]),
    ("00000000000000000", &[8269, 10535, 830]),
];

#[test]
fn ids_and_counts_match_tiktokens_reference() {
    let t = Gpt2Tokenizer;
    for (text, want) in REFERENCE {
        let got = t.encode(text).unwrap();
        assert_eq!(got.len(), want.len(), "{text:?}: {got:?}");
        assert_eq!(&got, want, "{text:?}");
        assert_eq!(t.decode(want).unwrap(), *text);
    }
    // tiktoken: "hello <|endoftext|>" with the special token allowed is [31373, 220, 50256];
    // text is ordinary here, and the special id decodes to its text.
    assert_eq!(
        t.decode(&[31373, 220, 50256]).unwrap(),
        "hello <|endoftext|>"
    );
    assert_eq!(Gpt2Tokenizer::VOCAB, 50257);
    assert_eq!(Tokenizer::Gpt2.vocab(), 50257);
}

#[test]
fn the_readme_corpus_round_trips() {
    let dir = std::path::Path::new("/usr/share/common-licenses");
    let mut texts = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        let mut files: Vec<_> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        for f in files {
            let bytes = std::fs::read(&f).unwrap();
            // The corpus reads bytes; BPE works on text: the files are UTF-8.
            texts.push((f.display().to_string(), String::from_utf8(bytes).unwrap()));
        }
    }
    texts.push(("generated".into(), generated_text(0, 200_000)));
    let t = Gpt2Tokenizer;
    let (mut bytes, mut ids) = (0, 0);
    for (name, text) in &texts {
        let enc = t.encode(text).unwrap();
        assert_eq!(&t.decode(&enc).unwrap(), text, "{name} does not round-trip");
        assert!(enc.iter().all(|&i| (i as usize) < Gpt2Tokenizer::VOCAB));
        bytes += text.len();
        ids += enc.len();
    }
    eprintln!(
        "{} texts, {bytes} bytes -> {ids} GPT-2 ids ({:.2} bytes per id)",
        texts.len(),
        bytes as f64 / ids as f64
    );
    // English compresses to well under one id per 2 bytes.
    assert!(ids * 2 < bytes, "{bytes} bytes -> {ids} ids");
    // The default corpus through the GPT-2 tokenizer has its vocabulary.
    let c = Corpus::default_corpus(0, &Tokenizer::Gpt2).unwrap();
    assert_eq!(c.vocab(), 50257);
    assert!(c.len() > 1000);
}
