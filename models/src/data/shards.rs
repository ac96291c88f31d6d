//! Token shards on disk, memory-mapped: nanoGPT's raw `.bin` (little-endian u16 ids, nothing
//! else) and llm.c's (a header of 256 little-endian i32: magic, version, token count; then the
//! ids: u16 under GPT-2's magic 20240520 version 1, u32 under Llama 3's magic 20240801 version
//! 7). `ShardSet::open` expands a glob, maps each regular file, tells its format and id width
//! by its header (`header`: a damaged header is refused, a pre-tokenized file is not a shard),
//! checks header and size against the format and every id against the vocabulary, naming the
//! file, the field and the byte offset of the first problem; `write_shard` writes either
//! format at either width llm.c defines.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::error::DataError;
use super::header::{identify, IdWidth, LlmcHeader, TokenHeader, LLMC_HEADER_BYTES};

/// The layout of a shard file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ShardFormat {
    /// llm.c when the file starts with one of its magics, else raw; every shard of a set must
    /// then be of the first one's format and id width.
    #[default]
    Auto,
    /// nanoGPT: little-endian u16 ids only.
    Raw,
    /// llm.c: the 1024-byte header, then little-endian ids of the width its magic says.
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

/// One mapped shard: `len` ids of `width` starting at byte `start`.
#[derive(Debug)]
pub struct Shard {
    path: PathBuf,
    map: Option<Mmap>,
    start: usize,
    len: usize,
    width: IdWidth,
}

fn shard_err(path: &Path, offset: u64, detail: String) -> DataError {
    DataError::Shard {
        path: path.to_path_buf(),
        offset,
        detail,
    }
}

/// The (first id's byte, id count, id width) of llm.c shard `bytes` at `path`, its header
/// checked against its magic's format and the file's size.
fn llmc_layout(path: &Path, bytes: &[u8]) -> Result<(usize, usize, IdWidth), DataError> {
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
    let word = |i: usize| {
        i32::from_le_bytes([
            bytes[4 * i],
            bytes[4 * i + 1],
            bytes[4 * i + 2],
            bytes[4 * i + 3],
        ])
    };
    let (magic, version, count) = (word(0), word(1), word(2));
    let kind = LlmcHeader::of_magic(magic).ok_or_else(|| {
        shard_err(
            path,
            0,
            format!(
                "the llm.c header's magic (bytes 0..4) is {magic}, neither {} nor {} (read as \
                 an llm.c shard, as asked)",
                LlmcHeader::of_width(IdWidth::U16).describe(),
                LlmcHeader::of_width(IdWidth::U32).describe()
            ),
        )
    })?;
    if version != kind.version {
        let other = LlmcHeader::of_width(match kind.width {
            IdWidth::U16 => IdWidth::U32,
            IdWidth::U32 => IdWidth::U16,
        });
        return Err(shard_err(
            path,
            4,
            format!(
                "the llm.c header's version (bytes 4..8) is {version}, not {} (magic {} is \
                 llm.c's {} format, {} ids; its {} format is {})",
                kind.version,
                kind.magic,
                kind.model,
                kind.width,
                other.model,
                other.describe()
            ),
        ));
    }
    let count = usize::try_from(count).map_err(|_| {
        shard_err(
            path,
            8,
            format!("the llm.c header's token count (bytes 8..12) is negative: {count}"),
        )
    })?;
    let want = LLMC_HEADER_BYTES as u64 + kind.width.bytes() as u64 * count as u64;
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
                "the llm.c header's token count (bytes 8..12) is {count} ({want} bytes with \
                 the header, {} ids) but the file has {} bytes: {how}",
                kind.width,
                bytes.len()
            ),
        ));
    }
    Ok((LLMC_HEADER_BYTES, count, kind.width))
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
        let head = &bytes[..bytes.len().min(LLMC_HEADER_BYTES)];
        let found = match format {
            // Told the format: only an exact magic says otherwise (and the format's own checks
            // name a damaged field).
            ShardFormat::Auto => identify(head, meta.len()).map_err(|e| shard_err(path, 0, e))?,
            _ => identify(head, meta.len()).unwrap_or(TokenHeader::None),
        };
        if let TokenHeader::Pretokenized(w) = found {
            return Err(shard_err(
                path,
                0,
                format!(
                    "starts with a pre-tokenized magic (OXFTOK, {w} ids): a pre-tokenized \
                     file, not a token shard (such a file is read whole, on its own)"
                ),
            ));
        }
        let format = match (format, found) {
            (ShardFormat::Auto, TokenHeader::Llmc(_)) => ShardFormat::Llmc,
            (ShardFormat::Auto, _) => ShardFormat::Raw,
            (f, _) => f,
        };
        let (start, len, width) = match format {
            ShardFormat::Llmc => llmc_layout(path, bytes)?,
            _ => {
                if let TokenHeader::Llmc(w) = found {
                    return Err(shard_err(
                        path,
                        0,
                        format!(
                            "starts with llm.c's magic {} but is read as a raw shard (the \
                             set's first shard is raw, or --shard-format raw)",
                            LlmcHeader::of_width(w).magic
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
                (0, bytes.len() / 2, IdWidth::U16)
            }
        };
        let shard = Shard {
            path: path.to_path_buf(),
            map,
            start,
            len,
            width,
        };
        shard.check_vocab(vocab)?;
        Ok((shard, format))
    }

    fn ids(&self) -> &[u8] {
        let w = self.width.bytes();
        self.map
            .as_deref()
            .map_or(&[][..], |b| &b[self.start..self.start + w * self.len])
    }

    /// The first id at or above `vocab` is an error naming its byte offset.
    fn check_vocab(&self, vocab: usize) -> Result<(), DataError> {
        let bad = self
            .width
            .decode(self.ids())
            .enumerate()
            .find(|&(_, id)| id as usize >= vocab);
        match bad {
            None => Ok(()),
            Some((i, id)) => Err(shard_err(
                &self.path,
                (self.start + self.width.bytes() * i) as u64,
                format!("token {i} is id {id}, not below the vocabulary size {vocab}"),
            )),
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
    /// How wide its stored ids are.
    pub fn width(&self) -> IdWidth {
        self.width
    }
    /// Ids `at..at + n` as i64 appended to `out` (ids past the end are an error).
    pub fn read_into(&self, at: usize, n: usize, out: &mut Vec<i64>) -> Result<(), DataError> {
        let w = self.width.bytes();
        let end = at
            .checked_add(n)
            .filter(|&e| e <= self.len)
            .ok_or_else(|| {
                shard_err(
                    &self.path,
                    (self.start + w * at) as u64,
                    format!(
                        "ids {at}..{} beyond its {} ids",
                        at.saturating_add(n),
                        self.len
                    ),
                )
            })?;
        let b = &self.ids()[w * at..w * end];
        out.extend(self.width.decode(b).map(i64::from));
        Ok(())
    }
}

/// The shards a glob names, in name order, all of one format and id width.
#[derive(Debug)]
pub struct ShardSet {
    pub pattern: String,
    pub format: ShardFormat,
    pub width: IdWidth,
    shards: Vec<Shard>,
}

impl ShardSet {
    /// Maps every file `pattern` matches (a path or a glob; at least one) as `format`, checking
    /// each (see `Shard::open`); under `Auto` the first shard's format is every shard's, and
    /// every shard's ids are as wide as the first one's.
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
        let mut shards: Vec<Shard> = Vec::with_capacity(files.len());
        for f in &files {
            let (s, got) = Shard::open(f, format, vocab)?;
            if let Some(first) = shards.first().filter(|first| first.width != s.width) {
                return Err(shard_err(
                    f,
                    0,
                    format!(
                        "holds {} ids but the set's first shard {} holds {} ids (llm.c's {} and \
                         {} formats: shards of two tokenizers)",
                        s.width,
                        first.path.display(),
                        first.width,
                        LlmcHeader::of_width(s.width).model,
                        LlmcHeader::of_width(first.width).model
                    ),
                ));
            }
            format = got;
            shards.push(s);
        }
        let width = shards[0].width;
        if (vocab as u64) > width.capacity() {
            let kind = match format {
                ShardFormat::Raw => "nanoGPT's raw format".to_string(),
                _ => format!("llm.c's {} format", LlmcHeader::of_width(width).model),
            };
            let wide = LlmcHeader::of_width(IdWidth::for_vocab(vocab));
            return Err(shard_err(
                &shards[0].path,
                0,
                format!(
                    "holds {width} ids ({kind}, at most {} ids) but the tokenizer's \
                     vocabulary has {vocab} ids: shards of another tokenizer (text tokenized \
                     with this one needs llm.c's {})",
                    width.capacity(),
                    wide.describe()
                ),
            ));
        }
        Ok(ShardSet {
            pattern: pattern.to_string(),
            format,
            width: shards[0].width,
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
    /// "llmc (u32 ids)".
    pub fn describe_format(&self) -> String {
        format!("{} ({} ids)", self.format.name(), self.width)
    }
}

/// Writes `bytes` to `path` through a temporary file beside it, synced and renamed into place.
pub(super) fn write_atomically(
    op: &'static str,
    path: &Path,
    bytes: &[u8],
) -> Result<(), DataError> {
    let io = |source| DataError::Io {
        op,
        path: path.to_path_buf(),
        source,
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = File::create(&tmp).map_err(io)?;
    f.write_all(bytes).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// Writes `ids` to `path` as one shard of `format` (`Auto` writes llm.c's) with ids of `width`
/// (llm.c: its GPT-2 header for u16, its Llama 3 header for u32; raw: u16 only). An id that
/// does not fit `width` is an error and nothing is written.
pub fn write_shard(
    path: &Path,
    format: ShardFormat,
    width: IdWidth,
    ids: &[u32],
) -> Result<(), DataError> {
    let mut bytes = Vec::with_capacity(LLMC_HEADER_BYTES + width.bytes() * ids.len());
    if format == ShardFormat::Raw {
        if width != IdWidth::U16 {
            return Err(shard_err(
                path,
                0,
                format!(
                    "the raw format (nanoGPT's) holds u16 ids only, not {width}: write llm.c's \
                     format, whose {} header holds them",
                    LlmcHeader::of_width(width).describe()
                ),
            ));
        }
    } else {
        let count = i32::try_from(ids.len()).map_err(|_| {
            shard_err(
                path,
                8,
                format!("{} ids do not fit llm.c's i32 token count", ids.len()),
            )
        })?;
        let kind = LlmcHeader::of_width(width);
        let mut header = [0i32; LLMC_HEADER_BYTES / 4];
        header[0] = kind.magic;
        header[1] = kind.version;
        header[2] = count;
        for h in header {
            bytes.extend(h.to_le_bytes());
        }
    }
    let at = bytes.len();
    width.encode_into(ids, &mut bytes).map_err(|(i, id)| {
        shard_err(
            path,
            (at + width.bytes() * i) as u64,
            format!("token {i} is id {id}, which does not fit {width}"),
        )
    })?;
    write_atomically("write_shard", path, &bytes)
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
        let ids: Vec<u32> = (0..1000u32).map(|i| i.wrapping_mul(37) % 300).collect();
        for (name, f) in [("a.bin", ShardFormat::Raw), ("b.bin", ShardFormat::Llmc)] {
            write_shard(&d.join(name), f, IdWidth::U16, &ids).unwrap();
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
            e.contains("b.bin at byte 0: starts with llm.c's magic 20240520"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn u32_shards_round_trip_and_are_never_mixed_or_narrowed() {
        let d = dir("wide");
        let ids: Vec<u32> = (0..500u32).map(|i| i * 263 % 128_256).collect();
        write_shard(&d.join("a.bin"), ShardFormat::Llmc, IdWidth::U32, &ids).unwrap();
        let bytes = std::fs::read(d.join("a.bin")).unwrap();
        assert_eq!(bytes.len(), 1024 + 4 * 500);
        assert_eq!(
            &bytes[..12],
            &[0xa1, 0xd9, 0x34, 0x01, 7, 0, 0, 0, 0xf4, 1, 0, 0]
        );
        let (s, got) = Shard::open(&d.join("a.bin"), ShardFormat::Auto, 128_256).unwrap();
        assert_eq!((got, s.width()), (ShardFormat::Llmc, IdWidth::U32));
        let mut out = Vec::new();
        s.read_into(0, 500, &mut out).unwrap();
        assert_eq!(out, ids.iter().map(|&i| i64::from(i)).collect::<Vec<_>>());
        let e = Shard::open(&d.join("a.bin"), ShardFormat::Auto, 50_257)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not below the vocabulary size 50257"), "{e}");
        // A u16 shard beside it: two tokenizers' data in one set.
        let small: Vec<u32> = ids.iter().map(|i| i % 1000).collect();
        write_shard(&d.join("b.bin"), ShardFormat::Llmc, IdWidth::U16, &small).unwrap();
        let e = ShardSet::open(
            d.join("*.bin").to_str().unwrap(),
            ShardFormat::Auto,
            128_256,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("b.bin at byte 0: holds u16 ids but"), "{e}");
        // Writers refuse what their width cannot hold.
        let e = write_shard(&d.join("c.bin"), ShardFormat::Raw, IdWidth::U32, &ids).unwrap_err();
        assert!(e.to_string().contains("holds u16 ids only"), "{e}");
        let e = write_shard(&d.join("c.bin"), ShardFormat::Llmc, IdWidth::U16, &ids).unwrap_err();
        assert!(e.to_string().contains("which does not fit u16"), "{e}");
        assert!(!d.join("c.bin").exists());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn u16_shards_are_refused_for_a_vocabulary_beyond_16_bits() {
        let d = dir("narrow");
        let ids: Vec<u32> = (0..300u32).map(|i| i * 211 % 65_536).collect();
        for (name, f) in [("a.bin", ShardFormat::Llmc), ("r.bin", ShardFormat::Raw)] {
            let p = d.join(name);
            write_shard(&p, f, IdWidth::U16, &ids).unwrap();
            // Every id is below the vocabulary, and 65,536 ids still fit u16.
            ShardSet::open(p.to_str().unwrap(), ShardFormat::Auto, 65_536).unwrap();
            let e = ShardSet::open(p.to_str().unwrap(), ShardFormat::Auto, 65_537)
                .unwrap_err()
                .to_string();
            let kind = if f == ShardFormat::Raw {
                "nanoGPT's raw format"
            } else {
                "llm.c's GPT-2 format"
            };
            assert!(
                e.contains(&format!(
                    "{name} at byte 0: holds u16 ids ({kind}, at most 65536"
                )) && e.contains("vocabulary has 65537 ids")
                    && e.contains("magic 20240801 version 7"),
                "{e}"
            );
        }
        let _ = std::fs::remove_dir_all(&d);
    }
}
