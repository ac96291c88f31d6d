//! Token shards on disk, memory-mapped: nanoGPT's raw `.bin` (little-endian u16 ids, nothing
//! else) and llm.c's (a header of 256 little-endian i32: magic 20240520, version 1, token
//! count; then the u16 ids). `ShardSet::open` expands a glob, maps each regular file, tells its
//! format by its header (`header`: a damaged header is refused, a pre-tokenized file is not a
//! shard), checks header and size against the format and every id against the vocabulary,
//! naming the file, the field and the byte offset of the first problem; `write_shard` writes
//! either format.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::error::DataError;
use super::header::{identify, TokenHeader};

/// llm.c's header magic.
pub const LLMC_MAGIC: i32 = 20240520;
/// llm.c's header version for u16 GPT-2 tokens (version 2 holds u32 ids).
pub const LLMC_VERSION: i32 = 1;
/// Bytes of llm.c's header (256 i32).
pub const LLMC_HEADER_BYTES: usize = 1024;

/// The layout of a shard file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ShardFormat {
    /// llm.c when the file starts with its magic, else raw; every shard of a set must then
    /// be of the first one's format.
    #[default]
    Auto,
    /// nanoGPT: little-endian u16 ids only.
    Raw,
    /// llm.c: the 1024-byte header, then little-endian u16 ids.
    Llmc,
}

impl ShardFormat {
    pub fn name(self) -> &'static str {
        match self {
            ShardFormat::Auto => "auto",
            ShardFormat::Raw => "raw",
            ShardFormat::Llmc => "llmc",
        }
    }
}

/// One mapped shard: `len` ids starting at byte `start`.
#[derive(Debug)]
pub struct Shard {
    path: PathBuf,
    map: Option<Mmap>,
    start: usize,
    len: usize,
}

fn shard_err(path: &Path, offset: u64, detail: String) -> DataError {
    DataError::Shard {
        path: path.to_path_buf(),
        offset,
        detail,
    }
}

impl Shard {
    /// Maps `path` (a regular file) and checks it as `format` (`Auto`: by its first bytes);
    /// returns the shard and the format it has. Ids are checked against `vocab`.
    pub fn open(
        path: &Path,
        format: ShardFormat,
        vocab: usize,
    ) -> Result<(Shard, ShardFormat), DataError> {
        let io = |source| DataError::Io {
            op: "token shard",
            path: path.to_path_buf(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_file() {
            return Err(shard_err(path, 0, "not a regular file".into()));
        }
        let file = File::open(path).map_err(io)?;
        let map = if meta.len() == 0 {
            None
        } else {
            // SAFETY: the map is read-only and private to this process; a file truncated or
            // rewritten by another process while mapped is outside this program's contract
            // (as for every reader of memory-mapped data), and sizes are checked below.
            Some(unsafe { Mmap::map(&file) }.map_err(io)?)
        };
        let bytes: &[u8] = map.as_deref().unwrap_or(&[]);
        let header = |i: usize| -> Option<i32> {
            bytes
                .get(4 * i..4 * i + 4)
                .and_then(|b| b.try_into().ok())
                .map(i32::from_le_bytes)
        };
        let head = &bytes[..bytes.len().min(LLMC_HEADER_BYTES)];
        let found = match format {
            // Told the format: only an exact magic says otherwise (and the format's own checks
            // name a damaged field).
            ShardFormat::Auto => identify(head, meta.len()).map_err(|e| shard_err(path, 0, e))?,
            _ => identify(head, meta.len()).unwrap_or(TokenHeader::None),
        };
        if found == TokenHeader::Pretokenized {
            return Err(shard_err(
                path,
                0,
                "starts with OXFTOK16: a pre-tokenized file, not a token shard (such a file \
                 is read whole, on its own)"
                    .into(),
            ));
        }
        let format = match (format, found) {
            (ShardFormat::Auto, TokenHeader::Llmc) => ShardFormat::Llmc,
            (ShardFormat::Auto, _) => ShardFormat::Raw,
            (f, _) => f,
        };
        let (start, len) = match format {
            ShardFormat::Llmc => {
                if bytes.len() < LLMC_HEADER_BYTES {
                    return Err(shard_err(
                        path,
                        bytes.len() as u64,
                        format!(
                            "truncated: {} bytes, shorter than llm.c's {LLMC_HEADER_BYTES}-byte header",
                            bytes.len()
                        ),
                    ));
                }
                let (magic, version, count) = (header(0), header(1), header(2));
                if magic != Some(LLMC_MAGIC) {
                    return Err(shard_err(
                        path,
                        0,
                        format!(
                            "the llm.c header's magic (bytes 0..4) is {}, not {LLMC_MAGIC} (read \
                             as an llm.c shard, as asked)",
                            magic.unwrap_or_default()
                        ),
                    ));
                }
                if version != Some(LLMC_VERSION) {
                    return Err(shard_err(
                        path,
                        4,
                        format!(
                            "the llm.c header's version (bytes 4..8) is {}, not {LLMC_VERSION} \
                             (u16 GPT-2 ids)",
                            version.unwrap_or_default()
                        ),
                    ));
                }
                let count = usize::try_from(count.unwrap_or(-1)).map_err(|_| {
                    shard_err(
                        path,
                        8,
                        format!(
                            "the llm.c header's token count (bytes 8..12) is negative: {}",
                            count.unwrap_or_default()
                        ),
                    )
                })?;
                let want = LLMC_HEADER_BYTES as u64 + 2 * count as u64;
                if (bytes.len() as u64) != want {
                    let how = if (bytes.len() as u64) < want {
                        "truncated or miscounted"
                    } else {
                        "longer than counted"
                    };
                    return Err(shard_err(
                        path,
                        8,
                        format!(
                            "the llm.c header's token count (bytes 8..12) is {count} ({want} \
                             bytes with the header) but the file has {} bytes: {how}",
                            bytes.len()
                        ),
                    ));
                }
                (LLMC_HEADER_BYTES, count)
            }
            _ => {
                if found == TokenHeader::Llmc {
                    return Err(shard_err(
                        path,
                        0,
                        format!(
                            "starts with llm.c's magic {LLMC_MAGIC} but is read as a raw shard (the set's first shard is raw, or --shard-format raw)"
                        ),
                    ));
                }
                if !bytes.len().is_multiple_of(2) {
                    return Err(shard_err(
                        path,
                        bytes.len() as u64 - 1,
                        format!(
                            "truncated: {} bytes is not a whole number of u16 ids",
                            bytes.len()
                        ),
                    ));
                }
                (0, bytes.len() / 2)
            }
        };
        let shard = Shard {
            path: path.to_path_buf(),
            map,
            start,
            len,
        };
        shard.check_vocab(vocab)?;
        Ok((shard, format))
    }

    fn ids(&self) -> &[u8] {
        self.map
            .as_deref()
            .map_or(&[][..], |b| &b[self.start..self.start + 2 * self.len])
    }

    /// The first id at or above `vocab` is an error naming its byte offset.
    fn check_vocab(&self, vocab: usize) -> Result<(), DataError> {
        let bad = self
            .ids()
            .chunks_exact(2)
            .position(|c| usize::from(u16::from_le_bytes([c[0], c[1]])) >= vocab);
        match bad {
            None => Ok(()),
            Some(i) => {
                let b = &self.ids()[2 * i..2 * i + 2];
                Err(shard_err(
                    &self.path,
                    (self.start + 2 * i) as u64,
                    format!(
                        "token {i} is id {}, not below the vocabulary size {vocab}",
                        u16::from_le_bytes([b[0], b[1]])
                    ),
                ))
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Number of ids.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Ids `at..at + n` as i64 appended to `out` (ids past the end are an error).
    pub fn read_into(&self, at: usize, n: usize, out: &mut Vec<i64>) -> Result<(), DataError> {
        let end = at
            .checked_add(n)
            .filter(|&e| e <= self.len)
            .ok_or_else(|| {
                shard_err(
                    &self.path,
                    (self.start + 2 * at) as u64,
                    format!(
                        "ids {at}..{} beyond its {} ids",
                        at.saturating_add(n),
                        self.len
                    ),
                )
            })?;
        let b = &self.ids()[2 * at..2 * end];
        out.extend(
            b.chunks_exact(2)
                .map(|c| i64::from(u16::from_le_bytes([c[0], c[1]]))),
        );
        Ok(())
    }
}

/// The shards a glob names, in name order, all of one format.
#[derive(Debug)]
pub struct ShardSet {
    pub pattern: String,
    pub format: ShardFormat,
    shards: Vec<Shard>,
}

impl ShardSet {
    /// Maps every file `pattern` matches (a path or a glob; at least one) as `format`, checking
    /// each (see `Shard::open`); under `Auto` the first shard's format is every shard's.
    pub fn open(pattern: &str, format: ShardFormat, vocab: usize) -> Result<ShardSet, DataError> {
        let glob_err = |detail: String| DataError::Glob {
            what: "token shards",
            pattern: pattern.to_string(),
            detail,
        };
        let paths = glob::glob(pattern).map_err(|e| glob_err(e.to_string()))?;
        let mut files = Vec::new();
        for p in paths {
            files.push(p.map_err(|e| glob_err(e.to_string()))?);
        }
        files.sort();
        if files.is_empty() {
            return Err(glob_err("no file matches".into()));
        }
        let mut format = format;
        let mut shards = Vec::with_capacity(files.len());
        for f in &files {
            let (s, got) = Shard::open(f, format, vocab)?;
            format = got;
            shards.push(s);
        }
        Ok(ShardSet {
            pattern: pattern.to_string(),
            format,
            shards,
        })
    }
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }
    /// Ids in all shards.
    pub fn tokens(&self) -> usize {
        self.shards.iter().map(Shard::len).sum()
    }
}

/// Writes `ids` to `path` as one shard of `format` (`Auto` writes llm.c's), through a temporary
/// file renamed into place.
pub fn write_shard(path: &Path, format: ShardFormat, ids: &[u16]) -> Result<(), DataError> {
    let io = |source| DataError::Io {
        op: "write_shard",
        path: path.to_path_buf(),
        source,
    };
    let mut bytes = Vec::with_capacity(LLMC_HEADER_BYTES + 2 * ids.len());
    if format != ShardFormat::Raw {
        let count = i32::try_from(ids.len()).map_err(|_| {
            shard_err(
                path,
                8,
                format!("{} ids do not fit llm.c's i32 token count", ids.len()),
            )
        })?;
        let mut header = [0i32; LLMC_HEADER_BYTES / 4];
        header[0] = LLMC_MAGIC;
        header[1] = LLMC_VERSION;
        header[2] = count;
        for h in header {
            bytes.extend(h.to_le_bytes());
        }
    }
    for id in ids {
        bytes.extend(id.to_le_bytes());
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = File::create(&tmp).map_err(io)?;
    f.write_all(&bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("oxiflow-shards-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn both_formats_round_trip_and_auto_detects_them() {
        let d = dir("roundtrip");
        let ids: Vec<u16> = (0..1000u16).map(|i| i.wrapping_mul(37) % 300).collect();
        for (name, f) in [("a.bin", ShardFormat::Raw), ("b.bin", ShardFormat::Llmc)] {
            write_shard(&d.join(name), f, &ids).unwrap();
            let (s, got) = Shard::open(&d.join(name), ShardFormat::Auto, 300).unwrap();
            assert_eq!(got, f);
            let mut out = Vec::new();
            s.read_into(0, ids.len(), &mut out).unwrap();
            assert_eq!(out, ids.iter().map(|&i| i64::from(i)).collect::<Vec<_>>());
            assert!(s.read_into(999, 2, &mut out).is_err());
        }
        let e = ShardSet::open(d.join("*.bin").to_str().unwrap(), ShardFormat::Auto, 300)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("b.bin at byte 0: starts with llm.c's magic"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
