//! Fuzzing the checkpoint decoders (proptest-driven, a fixed number of cases seeded from
//! `fuzz/corpus/`): manifest bytes, manifests built from layouts (checked against a layout
//! reference written here and a brute-force tiling check, with pieces moved, swapped, dropped
//! and duplicated), and data files of a real checkpoint, mutated with and without
//! their checksums fixed up. Every input must load or give a typed checkpoint error.

mod fuzz_input;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use oxiflow::checkpoint::{self, FileEntry, LayoutEntry, Manifest, PieceEntry, TensorEntry};
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

/// A tensor shape (0 to 2 dims of 0..5), a mesh (1 or 2 axes of 1..4 ranks) and per mesh
/// axis `B` or a split of one of the shape's dims.
fn small_layout() -> impl Strategy<Value = (Vec<usize>, Vec<usize>, Vec<Option<usize>>)> {
    (
        prop::collection::vec(0usize..5, 0..3),
        prop::collection::vec(1usize..4, 1..3),
    )
        .prop_flat_map(|(shape, mesh)| {
            let nd = shape.len();
            let axis = if nd == 0 {
                Just(None).boxed()
            } else {
                prop_oneof![Just(None), (0..nd).prop_map(Some)].boxed()
            };
            let n = mesh.len();
            (Just(shape), Just(mesh), prop::collection::vec(axis, n..=n))
        })
}

/// The pieces of `shape` under (`mesh`, `splits`), computed here independently of the
/// library: balanced splits (the first n % k parts one larger), axis 0 outermost, copies
/// along broadcast axes written by coordinate 0, empty pieces not written.
fn reference_pieces(
    shape: &[usize],
    mesh: &[usize],
    splits: &[Option<usize>],
) -> Vec<(usize, Vec<[usize; 2]>)> {
    let total: usize = mesh.iter().product();
    let mut out = Vec::new();
    for idx in 0..total {
        let mut coord = vec![0; mesh.len()];
        let mut rest = idx;
        for a in (0..mesh.len()).rev() {
            coord[a] = rest % mesh[a];
            rest /= mesh[a];
        }
        if splits
            .iter()
            .zip(&coord)
            .any(|(s, &c)| s.is_none() && c != 0)
        {
            continue;
        }
        let mut region: Vec<[usize; 2]> = shape.iter().map(|&n| [0, n]).collect();
        for (a, s) in splits.iter().enumerate() {
            if let Some(d) = *s {
                let [lo, hi] = region[d];
                let (n, k, i) = (hi - lo, mesh[a], coord[a]);
                let start = lo + i * (n / k) + i.min(n % k);
                region[d] = [start, start + n / k + usize::from(i < n % k)];
            }
        }
        if !region.is_empty() && region.iter().any(|[a, b]| a == b) {
            continue;
        }
        out.push((idx, region));
    }
    out
}

fn layout_entry(mesh: &[usize], splits: &[Option<usize>]) -> LayoutEntry {
    LayoutEntry {
        mesh: mesh.to_vec(),
        ranks: (0..mesh.iter().product()).collect(),
        sbp: splits
            .iter()
            .map(|s| s.map_or("B".to_string(), |d| format!("S({d})")))
            .collect(),
        axes: None,
    }
}

fn manifest_of(
    shape: &[usize],
    layout: Option<LayoutEntry>,
    pieces: &[(usize, Vec<[usize; 2]>)],
) -> Manifest {
    let file = |i: usize| format!("rank-{i:05}.safetensors");
    let writers: std::collections::BTreeSet<usize> = pieces.iter().map(|(w, _)| *w).collect();
    Manifest {
        format: "oxiflow-checkpoint".into(),
        version: 3,
        manifest_crc32c: 0,
        files: writers
            .iter()
            .map(|&i| FileEntry {
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
                layout,
                pieces: pieces
                    .iter()
                    .map(|(w, r)| PieceEntry {
                        file: file(*w),
                        region: r.clone(),
                        crc32c: 0,
                    })
                    .collect(),
            },
        )]),
        optimizer: None,
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
    fn pieces_are_accepted_exactly_where_their_layout_puts_them(
        (shape, mesh, splits) in small_layout(),
        mutation in 0usize..5,
        pick in any::<prop::sample::Index>(),
        other in any::<prop::sample::Index>(),
    ) {
        let want = reference_pieces(&shape, &mesh, &splits);
        let layout = layout_entry(&mesh, &splits);
        let ok = manifest_of(&shape, Some(layout.clone()), &want);
        prop_assert!(ok.validate().is_ok(), "{:?}: {:?}", ok, ok.validate());
        let regions: Vec<Vec<[usize; 2]>> = want.iter().map(|(_, r)| r.clone()).collect();
        prop_assert!(tiles_exactly(&shape, &regions));
        let mut bad = want.clone();
        if !bad.is_empty() {
            let i = pick.index(bad.len());
            let j = other.index(bad.len());
            match mutation {
                0 => {
                    bad.remove(i);
                }
                1 => bad.push(bad[i].clone()),
                2 => {
                    let r = bad[i].1.clone();
                    bad[i].1 = bad[j].1.clone();
                    bad[j].1 = r;
                }
                3 if !bad[i].1.is_empty() => {
                    let d = pick.index(bad[i].1.len());
                    bad[i].1[d][1] += 1;
                }
                _ => bad[i].0 += 1000,
            }
            if bad != want {
                let m = manifest_of(&shape, Some(layout), &bad);
                prop_assert!(m.validate().is_err(), "mutation {} passed: {:?}", mutation, bad);
            }
        }
    }

    #[test]
    fn arbitrary_pieces_pass_only_where_a_layout_puts_them((shape, regions) in small_manifest()) {
        // Pieces in files 0, 1, ... under a 1-d S(0) layout of as many ranks, or saved whole.
        let pieces: Vec<(usize, Vec<[usize; 2]>)> = regions.into_iter().enumerate().collect();
        let k = pieces.len().max(1);
        let splits = vec![(!shape.is_empty()).then_some(0)];
        let with_layout = manifest_of(&shape, Some(layout_entry(&[k], &splits)), &pieces);
        let reference = reference_pieces(&shape, &[k], &splits);
        prop_assert_eq!(with_layout.validate().is_ok(), pieces == reference);
        let whole = manifest_of(&shape, None, &pieces);
        let full: Vec<[usize; 2]> = shape.iter().map(|&n| [0, n]).collect();
        let one_full = pieces.len() == 1 && pieces[0].1 == full;
        prop_assert_eq!(whole.validate().is_ok(), one_full);
    }
}

#[test]
fn the_seed_manifests_are_valid() {
    for name in ["dp1-sgd.json", "scalar-and-empty.json", "tp2-adamw.json"] {
        let bytes = std::fs::read(corpus_dir("manifest").join(name)).unwrap();
        if let Err(e) = Manifest::parse(&bytes) {
            panic!("{name}: {e}");
        }
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
