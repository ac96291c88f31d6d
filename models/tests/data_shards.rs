//! Token shards: files written by this test's own writer (the bytes of nanoGPT's raw format and
//! of llm.c's headers, GPT-2's u16 and Llama 3's u32, spelled out here) read back exactly
//! through `ShardSet`; a sequential stream resumed mid-shard from a checkpoint's position
//! continues with the same batches; bad shards (damaged headers of either llm.c format
//! included) are errors naming the file, the field and the byte offset.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use oxiflow_models::data::{ShardFormat, ShardSet, ShardWindows, StreamOrigin, Windows};

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oxiflow-shards-it-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// nanoGPT's `train.bin`: the ids as little-endian u16, nothing else.
fn write_raw(path: &Path, ids: &[u16]) {
    let bytes: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

/// An llm.c header (256 little-endian i32: magic, version, the id count, zeros) followed by
/// `ids`, the ids' little-endian bytes.
fn write_llmc_bytes(path: &Path, (magic, version, count): (i32, i32, i32), ids: Vec<u8>) {
    let mut header = [0i32; 256];
    (header[0], header[1], header[2]) = (magic, version, count);
    let mut bytes: Vec<u8> = header.iter().flat_map(|h| h.to_le_bytes()).collect();
    bytes.extend(ids);
    std::fs::write(path, bytes).unwrap();
}

/// llm.c's GPT-2 shard: 256 little-endian i32 (20240520, 1, the id count, zeros), then u16
/// ids.
fn write_llmc(path: &Path, magic: i32, count: i32, ids: &[u16]) {
    let b = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    write_llmc_bytes(path, (magic, 1, count), b);
}

fn ids(n: usize, salt: u16) -> Vec<u16> {
    (0..n as u32)
        .map(|i| ((i * 7919 + u32::from(salt)) % 50257) as u16)
        .collect()
}

fn all_ids(set: &ShardSet) -> Vec<i64> {
    let mut out = Vec::new();
    for s in set.shards() {
        s.read_into(0, s.len(), &mut out).unwrap();
    }
    out
}

#[test]
fn both_formats_read_back_exactly() {
    let d = dir("exact");
    let (a, b) = (ids(3001, 1), ids(777, 2));
    write_raw(&d.join("raw_000.bin"), &a);
    write_raw(&d.join("raw_001.bin"), &b);
    write_llmc(&d.join("llmc_000.bin"), 20240520, a.len() as i32, &a);
    write_llmc(&d.join("llmc_001.bin"), 20240520, b.len() as i32, &b);
    let want: Vec<i64> = a.iter().chain(&b).map(|&i| i64::from(i)).collect();
    for (pattern, format) in [
        ("raw_*.bin", ShardFormat::Raw),
        ("raw_*.bin", ShardFormat::Auto),
        ("llmc_*.bin", ShardFormat::Llmc),
        ("llmc_*.bin", ShardFormat::Auto),
    ] {
        let set = open_ok(&d, pattern, format, 50257);
        assert_eq!(set.shards().len(), 2);
        assert_eq!(set.tokens(), want.len());
        assert_eq!(all_ids(&set), want, "{pattern} as {format:?}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_stream_resumed_mid_shard_continues_the_same_batches() {
    let d = dir("resume");
    for i in 0..4u16 {
        write_llmc(&d.join(format!("s_{i}.bin")), 20240520, 1000, &ids(1000, i));
    }
    let set = Arc::new(open_ok(&d, "s_*.bin", ShardFormat::Auto, 50257));
    let (train, _) = ShardWindows::split(set, 16, 0.1, None).unwrap();
    let stream = |origin| Windows::Sequential {
        windows: train.clone(),
        batch: 8,
        origin,
    };
    let full = stream(StreamOrigin::default());
    // A checkpoint at step 20 records the windows read so far; its position is mid-shard.
    let at = full.windows_before(20).unwrap();
    let position = full.describe_position(20).unwrap();
    assert!(
        position.contains("s_2.bin id ") && !position.contains(" id 0 "),
        "{position}"
    );
    let resumed = stream(StreamOrigin {
        step: 20,
        windows: at,
    });
    for step in 20..60 {
        for rows in [0..8, 0..4, 4..8, 3..5] {
            assert_eq!(
                full.rows(step, rows.clone()).unwrap(),
                resumed.rows(step, rows).unwrap(),
                "step {step}"
            );
        }
    }
    // Resumed with another batch size the stream still continues at the recorded window.
    let other = Windows::Sequential {
        windows: train.clone(),
        batch: 4,
        origin: StreamOrigin {
            step: 20,
            windows: at,
        },
    };
    assert_eq!(other.rows(20, 0..4).unwrap(), full.rows(20, 0..4).unwrap());
    let _ = std::fs::remove_dir_all(&d);
}

/// The shards `name` (a file or a pattern) in `d` opened as `format` for a vocabulary of
/// `vocab`.
fn open_ok(d: &Path, name: &str, format: ShardFormat, vocab: usize) -> ShardSet {
    ShardSet::open(d.join(name).to_str().unwrap(), format, vocab).unwrap()
}

/// The error of opening the shards `name` in `d` as `format` for a vocabulary of `vocab`.
fn open_err(d: &Path, name: &str, format: ShardFormat, vocab: usize) -> String {
    ShardSet::open(d.join(name).to_str().unwrap(), format, vocab)
        .unwrap_err()
        .to_string()
}

#[test]
fn bad_shards_name_the_file_and_offset() {
    let d = dir("bad");
    // Opening `name` as `format` is refused with an error naming every one of `wants`.
    let refused = |name: &str, format, wants: &[&str]| {
        let e = open_err(&d, name, format, 256);
        assert!(wants.iter().all(|w| e.contains(w)), "{e}");
    };
    write_llmc(&d.join("magic.bin"), 1234, 4, &[1, 2, 3, 4]);
    refused(
        "magic.bin",
        ShardFormat::Llmc,
        &["magic.bin at byte 0: the llm.c header's magic (bytes 0..4) is 1234"],
    );
    refused(
        "magic.bin",
        ShardFormat::Auto,
        &["magic.bin at byte 0: damaged llm.c header"],
    );
    write_llmc(&d.join("short.bin"), 20240520, 1000, &[1; 500]);
    refused(
        "short.bin",
        ShardFormat::Auto,
        &[
            "short.bin at byte 8: the llm.c header's token count (bytes 8..12) is 1000",
            "truncated",
        ],
    );
    std::fs::write(d.join("odd.bin"), [1u8, 0, 2]).unwrap();
    refused(
        "odd.bin",
        ShardFormat::Raw,
        &["odd.bin at byte 2: truncated"],
    );
    write_llmc(
        &d.join("vocab.bin"),
        20240520,
        8,
        &[1, 2, 3, 4, 5, 300, 7, 8],
    );
    refused(
        "vocab.bin",
        ShardFormat::Auto,
        &["vocab.bin at byte 1034: token 5 is id 300, not below the vocabulary size 256"],
    );
    refused(
        "none-*.bin",
        ShardFormat::Auto,
        &["none-*.bin", "no file matches"],
    );
    std::fs::create_dir_all(d.join("dir.bin")).unwrap();
    refused("dir.bin", ShardFormat::Auto, &["not a regular file"]);
    let _ = std::fs::remove_dir_all(&d);
}

/// llm.c's Llama 3 shard (dev/data/data_common.py, `write_datafile(..., "llama-3")`): 256
/// little-endian i32 (20240801, 7, the id count, zeros), then u32 ids.
fn write_llmc32(path: &Path, magic: i32, version: i32, count: i32, ids: &[u32]) {
    let b = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
    write_llmc_bytes(path, (magic, version, count), b);
}

/// Ids spread over Llama 3's 128,256-entry vocabulary, most above 65535.
fn wide_ids(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 104_729 + salt) % 128_256)
        .collect()
}

#[test]
fn llama3_shards_read_back_exactly_above_16_bits() {
    let d = dir("llama3");
    let (a, b) = (wide_ids(2001, 1), wide_ids(999, 2));
    assert!(a.iter().filter(|&&i| i > 65535).count() > 800);
    write_llmc32(&d.join("l_000.bin"), 20240801, 7, a.len() as i32, &a);
    write_llmc32(&d.join("l_001.bin"), 20240801, 7, b.len() as i32, &b);
    let want: Vec<i64> = a.iter().chain(&b).map(|&i| i64::from(i)).collect();
    for format in [ShardFormat::Llmc, ShardFormat::Auto] {
        let set = open_ok(&d, "l_*.bin", format, 128_256);
        assert_eq!(set.describe_format(), "llmc (u32 ids)");
        assert_eq!(all_ids(&set), want, "{format:?}");
    }
    // Windows over u32 shards carry the ids unchanged.
    let set = Arc::new(open_ok(&d, "l_*.bin", ShardFormat::Auto, 128_256));
    let w = ShardWindows::whole(set, 8).unwrap();
    let batch = w.batch(0, 2).unwrap();
    let first: Vec<i64> = a[..17].iter().map(|&i| i64::from(i)).collect();
    assert_eq!(batch.inputs, [&first[..8], &first[8..16]].concat());
    assert_eq!(batch.targets, [&first[1..9], &first[9..17]].concat());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn damaged_llama3_headers_name_the_field() {
    let d = dir("llama3-bad");
    let open = |name: &str, format| open_err(&d, name, format, 128_256);
    let ids = wide_ids(100, 3);
    // The GPT-2 version under the Llama 3 magic, and the reverse.
    write_llmc32(&d.join("v1.bin"), 20240801, 1, 100, &ids);
    let e = open("v1.bin", ShardFormat::Auto);
    assert!(
        e.contains("v1.bin at byte 4: the llm.c header's version (bytes 4..8) is 1, not 7"),
        "{e}"
    );
    write_llmc32(&d.join("v2.bin"), 20240520, 2, 100, &ids);
    let e = open("v2.bin", ShardFormat::Auto);
    assert!(
        e.contains("v2.bin at byte 4: the llm.c header's version (bytes 4..8) is 2, not 1")
            && e.contains("magic 20240801 version 7 (Llama 3, u32 ids)"),
        "{e}"
    );
    // One flipped bit of the magic.
    write_llmc32(&d.join("magic.bin"), 20240801 ^ 1 << 20, 7, 100, &ids);
    for format in [ShardFormat::Auto, ShardFormat::Llmc] {
        let e = open("magic.bin", format);
        assert!(
            e.contains("magic.bin at byte 0:") && e.contains("magic (bytes 0..4)"),
            "{e}"
        );
    }
    // A count that disagrees with the size, and a truncated last id.
    write_llmc32(&d.join("count.bin"), 20240801, 7, 101, &ids);
    let e = open("count.bin", ShardFormat::Auto);
    assert!(
        e.contains("count.bin at byte 8: the llm.c header's token count (bytes 8..12) is 101")
            && e.contains("u32 ids")
            && e.contains("truncated or miscounted"),
        "{e}"
    );
    write_llmc32(&d.join("cut.bin"), 20240801, 7, 100, &ids);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.join("cut.bin"))
        .unwrap();
    f.set_len(1024 + 4 * 100 - 2).unwrap();
    let e = open("cut.bin", ShardFormat::Auto);
    assert!(
        e.contains("cut.bin at byte 8") && e.contains("1422 bytes"),
        "{e}"
    );
    // An id at or past the vocabulary, at its byte offset.
    let mut bad = ids.clone();
    bad[7] = 128_256;
    write_llmc32(&d.join("vocab.bin"), 20240801, 7, 100, &bad);
    let e = open("vocab.bin", ShardFormat::Auto);
    assert!(
        e.contains(
            "vocab.bin at byte 1052: token 7 is id 128256, not below the vocabulary size 128256"
        ),
        "{e}"
    );
    // GPT-2 and Llama 3 shards in one set.
    write_llmc(&d.join("mix_0.bin"), 20240520, 4, &[1, 2, 3, 4]);
    write_llmc32(&d.join("mix_1.bin"), 20240801, 7, 100, &ids);
    let e = open("mix_*.bin", ShardFormat::Auto);
    assert!(
        e.contains("mix_1.bin at byte 0: holds u32 ids but the set's first shard"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&d);
}
