//! The folder of real inputs the file cases aim at: a text corpus, token shards with whole and
//! damaged headers, tokenizer folders, a job file, the metrics and plot of another run, and
//! checkpoints, some with manifests edited as a hostile user would.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::catalogue_damages::edit;
use crate::common::{argv, succeed_in};

/// The folder of real inputs the cases aim at.
pub struct Inputs(pub PathBuf);

/// A metrics file of another run.
pub const OTHER_RUN: &str = "{\"kind\":\"run\",\"run_id\":\"feedface00000000\",\"from_step\":0}\n";

impl Inputs {
    /// The folder, with a checkpoint `ck` of a 2-step MLP made by `train`.
    pub fn new(tag: &str, train: &Path) -> Inputs {
        let d = std::env::temp_dir().join(format!(
            "oxiflow-catalogue-files-{}-{tag}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("sub")).unwrap();
        let text: String = (0..4000)
            .map(|i| format!("line {i} of the corpus\n"))
            .collect();
        std::fs::write(d.join("c.txt"), &text).unwrap();
        std::fs::hard_link(d.join("c.txt"), d.join("hard.txt")).unwrap();
        std::os::unix::fs::symlink(d.join("c.txt"), d.join("link.jsonl")).unwrap();
        std::os::unix::fs::symlink(&d, d.join("sub/up")).unwrap();
        std::fs::write(d.join("s.lock"), &text[..2000]).unwrap();
        std::fs::write(d.join("j.config.toml"), "[run]\nlog-every = 1\n").unwrap();
        std::fs::write(d.join("other.jsonl"), OTHER_RUN).unwrap();
        std::fs::write(d.join("notes.txt"), "my notes\n").unwrap();
        std::fs::write(
            d.join("other.svg"),
            "<svg xmlns=\"http://www.w3.org/2000/svg\"><!-- oxiflow-run feedface00000000 --></svg>\n",
        )
        .unwrap();
        std::fs::write(
            d.join("drawing.svg"),
            "<svg xmlns=\"http://www.w3.org/2000/svg\"/>\n",
        )
        .unwrap();
        let ids: Vec<u16> = (0..4000u16).map(|i| i % 200).collect();
        let le = |ids: &[u16]| -> Vec<u8> { ids.iter().flat_map(|i| i.to_le_bytes()).collect() };
        std::fs::write(d.join("ok.bin"), le(&ids)).unwrap();
        std::fs::write(d.join("val.bin"), le(&ids[..2000])).unwrap();
        token_files(&d, &ids);
        tokenizer_files(&d);
        std::fs::create_dir_all(d.join("set")).unwrap();
        std::fs::write(d.join("set/a.bin"), le(&ids)).unwrap();
        std::fs::write(d.join("set/b.bin"), le(&ids[..3000])).unwrap();
        let run = |args: &[&str]| {
            succeed_in(train, &d, args);
        };
        run(&["--model", "mlp", "--steps", "2", "--save", "ck"]);
        run(&argv(
            "--data set/a.bin --width 32 --layers 1 --seq-len 16 --gen-tokens 0 --steps 2 \
            --save gck",
        ));
        run(&argv(
            "--data c.txt --tokenizer tok --width 32 --layers 1 --seq-len 16 --gen-tokens 0 \
            --steps 2 --save tck",
        ));
        edited_copies(&d);
        Inputs(d)
    }
}

/// llm.c and pre-tokenized files of `ids`: whole, and with damaged headers.
fn token_files(d: &Path, ids: &[u16]) {
    // An llm.c header (256 i32: magic, version, token count) followed by the ids.
    let llmc = |name: &str, (magic, version, count): (i32, i32, i32), ids: &[u8]| {
        let mut h = vec![0i32; 256];
        (h[0], h[1], h[2]) = (magic, version, count);
        let mut b: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
        b.extend_from_slice(ids);
        std::fs::write(d.join(name), b).unwrap();
    };
    // A pre-tokenized header (8 magic bytes, the vocabulary size) followed by the ids.
    let pre = |name: &str, magic: &[u8], vocab: u32, ids: &[u8]| {
        let mut b = magic.to_vec();
        b.extend(vocab.to_le_bytes());
        b.extend_from_slice(ids);
        std::fs::write(d.join(name), b).unwrap();
    };
    let narrow: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    let n = ids.len() as i32;
    llmc("llmc.bin", (20240520, 1, n), &narrow);
    llmc("flip.bin", (20240520 ^ (1 << 9), 1, n), &narrow);
    llmc("version.bin", (20240520, 2, n), &narrow);
    llmc("count.bin", (20240520, 1, n + 7), &narrow);
    pre("pre.bin", b"OXFTOK16", 256, &narrow);
    pre("pre50k.bin", b"OXFTOK16", 50257, &narrow);
    pre("preflip.bin", b"OXFTOJ16", 256, &narrow);
    pre("pre.txt", b"OXFTOK16", 50257, &narrow);
    // The same with u32 ids: llm.c's Llama 3 shards (one id above 65535) and OXFTOK32.
    let wide: Vec<u8> = ids
        .iter()
        .map(|&i| u32::from(i))
        .chain([70_000])
        .flat_map(|i| i.to_le_bytes())
        .collect();
    let n = ids.len() as i32 + 1;
    llmc("l3.bin", (20240801, 7, n), &wide);
    llmc("l3flip.bin", (20240801 ^ (1 << 9), 7, n), &wide);
    llmc("l3version.bin", (20240801, 2, n), &wide);
    llmc("l3count.bin", (20240801, 7, n + 7), &wide);
    std::fs::create_dir_all(d.join("mix")).unwrap();
    std::fs::copy(d.join("llmc.bin"), d.join("mix/a.bin")).unwrap();
    std::fs::copy(d.join("l3.bin"), d.join("mix/b.bin")).unwrap();
    pre("pre32.bin", b"OXFTOK32", 70_344, &wide);
    pre("pre32flip.bin", b"OXFTOK33", 70_344, &wide);
}

/// Tokenizer folders from tests/fixtures/tokenizers: `tok` (GPT-2 style), `tok3` (Llama 3
/// style, as many ids), `tokw` (ids above 65535), and `badeos`, whose tokenizer_config.json
/// names an end-of-text token the tokenizer does not hold; tokenizer files that cannot be
/// used: `dropbyte.json` (a byte missing), `empty.json`, `emptytok/tokenizer.json`; a text
/// named like a shard of `prepare --out pq` (`pq_000000.bin`) and a link to it.
fn tokenizer_files(d: &Path) {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers");
    for (from, to) in [
        ("gpt2-style", "tok"),
        ("llama3-style", "tok3"),
        ("wide", "tokw"),
        ("llama3-style", "badeos"),
    ] {
        copy_dir(&fixtures.join(from), &d.join(to));
    }
    std::fs::write(
        d.join("badeos/tokenizer_config.json"),
        "{\"eos_token\": \"<|nope|>\"}\n",
    )
    .unwrap();
    // The GPT-2 style BPE without byte 0's character: it would drop that byte.
    let mut doc: Value =
        serde_json::from_slice(&std::fs::read(d.join("tok/tokenizer.json")).unwrap()).unwrap();
    doc["model"]["vocab"]
        .as_object_mut()
        .unwrap()
        .remove("\u{100}");
    std::fs::write(d.join("dropbyte.json"), doc.to_string()).unwrap();
    std::fs::write(d.join("empty.json"), "").unwrap();
    // Text named like a shard of `prepare --out pq`, and a link to it.
    std::fs::write(
        d.join("pq_000000.bin"),
        "a text that prepare must not overwrite\n",
    )
    .unwrap();
    std::os::unix::fs::symlink(d.join("pq_000000.bin"), d.join("pqlink.txt")).unwrap();
    std::fs::create_dir_all(d.join("emptytok")).unwrap();
    std::fs::write(d.join("emptytok/tokenizer.json"), "").unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Copies of the MLP checkpoint `ck` (at step 2, AdamW... SGD with momentum) with manifests
/// edited as a hostile user would, the checksum recomputed.
fn edited_copies(d: &Path) {
    type Edit = fn(&mut Value);
    let edits: [(&str, Edit); 4] = [
        ("ck-step", |m| m["metadata"]["step"] = json!("1")),
        ("ck-datastep", |m| m["metadata"]["step"] = json!("3")),
        ("ck-reset", |m| {
            let tensors = m["tensors"].as_object_mut().unwrap();
            let state: Vec<String> = tensors
                .keys()
                .filter(|k| k.starts_with("optim/"))
                .cloned()
                .collect();
            for k in &state {
                tensors.remove(k);
            }
            m["optimizer"]["empty"] = json!(state);
        }),
        ("ck-swap", |m| {
            let t = m["tensors"].as_object_mut().unwrap();
            let a = t.remove("optim/mlp.fc1.bias/momentum_buffer").unwrap();
            let b = t.remove("optim/mlp.fc2.bias/momentum_buffer").unwrap();
            t.insert("optim/mlp.fc1.bias/momentum_buffer".into(), b);
            t.insert("optim/mlp.fc2.bias/momentum_buffer".into(), a);
        }),
    ];
    for (name, f) in edits {
        copy_dir(&d.join("ck"), &d.join(name));
        edit(&d.join(name), f);
    }
}

impl Drop for Inputs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
