//! Shared by the fuzz tests: the seed corpus in `fuzz/corpus/<target>/` and a proptest
//! strategy that mutates a seed (bit flips, byte sets, truncation, insertion, duplication) the
//! way a coverage-blind fuzzer would, plus wholly random bytes.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use proptest::prelude::*;

pub fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz")
        .join("corpus")
        .join(target)
}

/// The seed files of `target`, sorted by name (at least one).
pub fn seeds(target: &str) -> Vec<Vec<u8>> {
    let dir = corpus_dir(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "corpus {} is empty", dir.display());
    files.iter().map(|f| std::fs::read(f).unwrap()).collect()
}

#[derive(Clone, Debug)]
pub enum Mutation {
    Flip(usize, u8),
    Set(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Duplicate(usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 0u8..8).prop_map(|(p, b)| Mutation::Flip(p, b)),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(p, v)| Mutation::Set(p, v)),
        1 => any::<usize>().prop_map(Mutation::Truncate),
        2 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(p, b)| Mutation::Insert(p, b)),
        1 => (any::<usize>(), 1usize..64).prop_map(|(p, n)| Mutation::Duplicate(p, n)),
    ]
}

pub fn apply(mut b: Vec<u8>, muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        let n = b.len();
        match m {
            Mutation::Flip(p, bit) if n > 0 => b[p % n] ^= 1 << bit,
            Mutation::Set(p, v) if n > 0 => b[p % n] = *v,
            Mutation::Truncate(p) => b.truncate(p % (n + 1)),
            Mutation::Insert(p, bytes) => {
                let at = p % (n + 1);
                b.splice(at..at, bytes.iter().copied());
            }
            Mutation::Duplicate(p, len) if n > 0 => {
                let at = p % n;
                let end = (at + len).min(n);
                let copy = b[at..end].to_vec();
                b.splice(end..end, copy);
            }
            _ => {}
        }
    }
    b
}

/// A mutated seed of `target` (index into `seeds`, mutations) or, one time in five, random
/// bytes of at most `max_random` bytes.
pub fn input(target: &str, max_random: usize) -> impl Strategy<Value = Vec<u8>> {
    let seeds = seeds(target);
    let n = seeds.len();
    prop_oneof![
        4 => (0..n, prop::collection::vec(mutation(), 0..8))
            .prop_map(move |(i, m)| apply(seeds[i].clone(), &m)),
        1 => prop::collection::vec(any::<u8>(), 0..max_random),
    ]
}
