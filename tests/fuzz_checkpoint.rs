//! Fuzzing the checkpoint decoders (proptest-driven, a fixed number of cases seeded from
//! `fuzz/corpus/`): manifest bytes, manifests built piece by piece (checked against a
//! brute-force tiling reference), and data files of a real checkpoint, mutated with and without
//! their checksums fixed up. Every input must load or give a typed checkpoint error.

mod fuzz_input;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use oxiflow::checkpoint::{self, FileEntry, Manifest, PieceEntry, TensorEntry};
use oxiflow::prelude::*;
use proptest::prelude::*;

use fuzz_input::{corpus_dir, input};

fn cases(n: u32) -> ProptestConfig {
    ProptestConfig {
        cases: n,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Whether `regions` tile `shape` exactly: every region non-empty and inside, every element
/// covered once (counted element by element).
fn tiles_exactly(shape: &[usize], regions: &[Vec<[usize; 2]>]) -> bool {
    let n: usize = shape.iter().product();
    let mut count = vec![0u32; n];
    for r in regions {
        if r.len() != shape.len() || r.iter().zip(shape).any(|([a, b], &d)| a >= b || *b > d) {
            return false;
        }
        let mut idx: Vec<usize> = r.iter().map(|[a, _]| *a).collect();
        loop {
            let flat = idx.iter().zip(shape).fold(0, |acc, (&i, &d)| acc * d + i);
            count[flat] += 1;
            let mut d = r.len();
            loop {
                if d == 0 {
                    break;
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < r[d][1] {
                    break;
                }
                idx[d] = r[d][0];
                if d == 0 {
                    d = usize::MAX;
                    break;
                }
            }
            if d == usize::MAX || r.is_empty() {
                break;
            }
        }
    }
    count.iter().all(|&c| c == 1)
}

fn region() -> impl Strategy<Value = [usize; 2]> {
    (0usize..5, 0usize..5).prop_map(|(a, b)| [a, b])
}

/// A manifest with one tensor of a small shape and up to 4 pieces in distinct files.
fn small_manifest() -> impl Strategy<Value = (Vec<usize>, Vec<Vec<[usize; 2]>>)> {
    prop::collection::vec(1usize..5, 0..3).prop_flat_map(|shape| {
        let nd = shape.len();
        (
            Just(shape),
            prop::collection::vec(prop::collection::vec(region(), nd..=nd), 0..5),
        )
    })
}

fn manifest_of(shape: &[usize], regions: &[Vec<[usize; 2]>]) -> Manifest {
    let file = |i: usize| format!("rank-{i:05}.safetensors");
    let pieces = regions
        .iter()
        .enumerate()
        .map(|(i, r)| PieceEntry {
            file: file(i),
            region: r.clone(),
            crc32c: 0,
        })
        .collect();
    Manifest {
        format: "oxiflow-checkpoint".into(),
        version: 2,
        files: (0..regions.len())
            .map(|i| FileEntry {
                name: file(i),
                bytes: 0,
                crc32c: 0,
            })
            .collect(),
        metadata: BTreeMap::new(),
        tensors: BTreeMap::from([(
            "w".to_string(),
            TensorEntry {
                shape: shape.to_vec(),
                dtype: "f32".into(),
                pieces,
            },
        )]),
        optimizer_state: Vec::new(),
    }
}

proptest! {
    #![proptest_config(cases(3000))]

    #[test]
    fn manifest_bytes_parse_or_fail(bytes in input("manifest", 512)) {
        // Never a panic; a manifest that passes covers each of its tensors exactly.
        if let Ok(m) = Manifest::parse(&bytes) {
            for t in m.tensors.values() {
                let regions: Vec<Vec<[usize; 2]>> = t.pieces.iter().map(|p| p.region.clone()).collect();
                let n = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
                if n.is_some_and(|n| n <= 1 << 16) {
                    prop_assert!(tiles_exactly(&t.shape, &regions), "{:?}", t);
                }
            }
        }
    }

    #[test]
    fn manifests_are_accepted_exactly_when_their_pieces_tile((shape, regions) in small_manifest()) {
        let m = manifest_of(&shape, &regions);
        let verdict = m.validate();
        prop_assert_eq!(verdict.is_ok(), tiles_exactly(&shape, &regions), "{:?}", verdict);
    }
}

fn fresh_copy(name: &str, case: u64) -> PathBuf {
    let dst =
        std::env::temp_dir().join(format!("oxiflow-fuzz-{}-{name}-{case}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(corpus_dir("checkpoint").join(name)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
    }
    dst
}

/// Loads every tensor of the checkpoint at `dir` into local tensors of its shapes.
fn load_all(dir: &Path) -> Result<(), TensorError> {
    let m = checkpoint::read_manifest_at(dir)?;
    let targets: Vec<(String, Tensor)> = m
        .tensors
        .iter()
        .map(|(name, t)| {
            let dtype = if t.dtype == "f64" {
                DType::F64
            } else {
                DType::F32
            };
            (name.clone(), Tensor::zeros(t.shape.clone(), dtype))
        })
        .collect();
    checkpoint::load_tensors(dir, &targets).map(|_| ())
}

#[test]
fn the_seed_checkpoint_loads() {
    let dir = fresh_copy("tp2-adamw", 0);
    load_all(&dir).unwrap();
    let _ = std::fs::remove_dir_all(dir);
}

proptest! {
    #![proptest_config(cases(300))]

    #[test]
    fn mutated_data_files_load_or_fail_typed(
        bytes in input("safetensors", 2048),
        file in 0usize..2,
        fix_checksum in any::<bool>(),
        case in any::<u64>(),
    ) {
        let dir = fresh_copy("tp2-adamw", case);
        let name = format!("rank-{file:05}.safetensors");
        let original = std::fs::read(dir.join(&name)).unwrap();
        std::fs::write(dir.join(&name), &bytes).unwrap();
        if fix_checksum {
            // Past the file checks: the safetensors header and piece checks must hold alone.
            let path = dir.join("manifest.json");
            let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            for f in m["files"].as_array_mut().unwrap() {
                if f["name"] == name.as_str() {
                    f["bytes"] = bytes.len().into();
                    f["crc32c"] = crc32c::crc32c(&bytes).into();
                }
            }
            std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
        }
        let r = load_all(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        match r {
            // Changed bytes load only past fixed-up file checksums, where every piece's own
            // checksum still matched (so the values are the saved ones).
            Ok(()) => prop_assert!(bytes == original || fix_checksum, "changed bytes loaded"),
            Err(e) => prop_assert!(matches!(e, TensorError::Checkpoint { .. }), "{e}"),
        }
    }
}
