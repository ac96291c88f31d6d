//! What a token file is, by its first bytes, and how wide its ids are: an llm.c shard (a
//! header of 256 little-endian i32: magic, version, token count, then zeros; magic 20240520
//! version 1 holds u16 GPT-2 ids, magic 20240801 version 7 u32 Llama 3 ids), a pre-tokenized
//! file (`OXFTOK16`: u16 ids, `OXFTOK32`: u32 ids), or neither (nanoGPT's raw u16 ids, or
//! text). A header a few bits away from a known magic, or an llm.c header (its reserved words
//! zero) whose magic is no llm.c magic, is damaged: refused, naming the field, rather than read
//! as tokens or text.

use std::io::Read;
use std::path::Path;

use super::error::DataError;

/// Bytes of llm.c's header (256 i32).
pub const LLMC_HEADER_BYTES: usize = 1024;
/// The first bytes of a pre-tokenized file of u16 ids.
pub const PRETOKENIZED_MAGIC: &[u8; 8] = b"OXFTOK16";
/// The first bytes of a pre-tokenized file of u32 ids.
pub const PRETOKENIZED32_MAGIC: &[u8; 8] = b"OXFTOK32";

/// How many bytes a stored token id takes (little-endian).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IdWidth {
    U16,
    U32,
}

impl IdWidth {
    /// Bytes per id.
    pub fn bytes(self) -> usize {
        match self {
            IdWidth::U16 => 2,
            IdWidth::U32 => 4,
        }
    }
    /// The narrowest width that holds every id below `vocab`.
    pub fn for_vocab(vocab: usize) -> IdWidth {
        if vocab <= usize::from(u16::MAX) + 1 {
            IdWidth::U16
        } else {
            IdWidth::U32
        }
    }
    /// The number of ids it can hold (65,536 or 2^32).
    pub fn capacity(self) -> u64 {
        match self {
            IdWidth::U16 => 1 << 16,
            IdWidth::U32 => 1 << 32,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            IdWidth::U16 => "u16",
            IdWidth::U32 => "u32",
        }
    }
    /// The ids of little-endian `bytes` (whole ids; a trailing part is ignored).
    pub fn decode(self, bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
        bytes.chunks_exact(self.bytes()).map(move |c| match self {
            IdWidth::U16 => u32::from(u16::from_le_bytes([c[0], c[1]])),
            IdWidth::U32 => u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        })
    }
    /// `ids` as little-endian bytes appended to `out`; the first id that does not fit is an
    /// error giving its index and value.
    pub fn encode_into(self, ids: &[u32], out: &mut Vec<u8>) -> Result<(), (usize, u32)> {
        out.reserve(ids.len() * self.bytes());
        for (i, &id) in ids.iter().enumerate() {
            match self {
                IdWidth::U16 => out.extend(u16::try_from(id).map_err(|_| (i, id))?.to_le_bytes()),
                IdWidth::U32 => out.extend(id.to_le_bytes()),
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for IdWidth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One of llm.c's shard headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlmcHeader {
    pub magic: i32,
    pub version: i32,
    pub width: IdWidth,
    /// The model whose tokenizer llm.c writes it for.
    pub model: &'static str,
}

/// llm.c's GPT-2 shards: u16 ids.
pub const LLMC_GPT2: LlmcHeader = LlmcHeader {
    magic: 20240520,
    version: 1,
    width: IdWidth::U16,
    model: "GPT-2",
};
/// llm.c's Llama 3 shards: u32 ids.
pub const LLMC_LLAMA3: LlmcHeader = LlmcHeader {
    magic: 20240801,
    version: 7,
    width: IdWidth::U32,
    model: "Llama 3",
};

impl LlmcHeader {
    /// The header llm.c writes for ids of `width`.
    pub fn of_width(width: IdWidth) -> LlmcHeader {
        match width {
            IdWidth::U16 => LLMC_GPT2,
            IdWidth::U32 => LLMC_LLAMA3,
        }
    }
    /// The header whose magic is `magic`.
    pub fn of_magic(magic: i32) -> Option<LlmcHeader> {
        [LLMC_GPT2, LLMC_LLAMA3]
            .into_iter()
            .find(|h| h.magic == magic)
    }
    /// "magic M version V (MODEL, WIDTH ids)".
    pub fn describe(&self) -> String {
        format!(
            "magic {} version {} ({}, {} ids)",
            self.magic, self.version, self.model, self.width
        )
    }
}

/// The kinds of token file a header names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenHeader {
    /// An llm.c header (its magic exact, so its width known; version and count are checked by
    /// the reader).
    Llmc(IdWidth),
    /// `OXFTOK16` or `OXFTOK32`, the vocabulary size, ids of that width.
    Pretokenized(IdWidth),
    /// No known magic: raw ids or text.
    None,
}

/// Differing bits of `a` and `b`.
fn bits_apart(a: &[u8], b: &[u8]) -> u32 {
    a.iter().zip(b).map(|(x, y)| (x ^ y).count_ones()).sum()
}

/// Bits a magic may differ by, with nothing else to go by, and still be taken for damage (two
/// ids of a raw file that far from a magic do not occur in practice).
const NEAR: u32 = 2;
/// Bits an llm.c magic may differ by when the rest of the header is llm.c's.
const NEAR_IN_HEADER: u32 = 8;

/// The header `head` (the file's first bytes, up to 1024) of a file of `len` bytes names, or
/// why it is damaged (the field, its bytes and what it should hold).
pub fn identify(head: &[u8], len: u64) -> Result<TokenHeader, String> {
    let word = |i: usize| -> Option<i32> {
        head.get(4 * i..4 * i + 4)
            .and_then(|b| b.try_into().ok())
            .map(i32::from_le_bytes)
    };
    let kinds = [LLMC_GPT2, LLMC_LLAMA3];
    if let Some(k) = kinds
        .iter()
        .find(|k| head.starts_with(&k.magic.to_le_bytes()))
    {
        return Ok(TokenHeader::Llmc(k.width));
    }
    for (magic, width) in [
        (PRETOKENIZED_MAGIC, IdWidth::U16),
        (PRETOKENIZED32_MAGIC, IdWidth::U32),
    ] {
        if head.starts_with(&magic[..]) {
            return Ok(TokenHeader::Pretokenized(width));
        }
    }
    if head.len() >= 8 {
        let apart = |m: &[u8; 8]| bits_apart(&head[..8], m);
        let (near, magic) = [PRETOKENIZED_MAGIC, PRETOKENIZED32_MAGIC]
            .into_iter()
            .map(|m| (apart(m), m))
            .min_by_key(|(a, _)| *a)
            .unwrap_or((u32::MAX, PRETOKENIZED_MAGIC));
        if near <= NEAR {
            return Err(format!(
                "damaged pre-tokenized header: its magic (bytes 0..8) reads {:?}, {near} bit(s) \
                 away from {:?}",
                String::from_utf8_lossy(&head[..8]),
                String::from_utf8_lossy(magic)
            ));
        }
    }
    let Some(first) = word(0) else {
        return Ok(TokenHeader::None);
    };
    let (apart, nearest) = kinds
        .iter()
        .map(|k| (bits_apart(&head[..4], &k.magic.to_le_bytes()), k))
        .min_by_key(|(a, _)| *a)
        .unwrap_or((u32::MAX, &LLMC_GPT2));
    let reserved_zero =
        head.len() >= LLMC_HEADER_BYTES && head[12..LLMC_HEADER_BYTES].iter().all(|&b| b == 0);
    let version_like = kinds.iter().any(|k| word(1) == Some(k.version));
    let count_like = word(2).is_some_and(|c| {
        c >= 0
            && kinds
                .iter()
                .any(|k| LLMC_HEADER_BYTES as u64 + k.width.bytes() as u64 * c as u64 == len)
    });
    let llmc_like = reserved_zero && (version_like || count_like || apart <= NEAR_IN_HEADER);
    if apart <= NEAR || llmc_like {
        return Err(format!(
            "damaged llm.c header: its magic (bytes 0..4) is {first}, {apart} bit(s) away from \
             llm.c's {} ({} shards; its other magic is {})",
            nearest.magic,
            nearest.model,
            kinds
                .iter()
                .find(|k| k.magic != nearest.magic)
                .map_or(0, |k| k.magic)
        ));
    }
    Ok(TokenHeader::None)
}

/// The header of the file at `path` (`TokenHeader::None` for anything that is not a regular
/// file: its reader says why it cannot be read).
pub fn identify_file(path: &Path) -> Result<TokenHeader, DataError> {
    let io = |source| DataError::Io {
        op: "reading the header of",
        path: path.to_path_buf(),
        source,
    };
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(TokenHeader::None);
    };
    if !meta.is_file() {
        return Ok(TokenHeader::None);
    }
    let mut head = Vec::with_capacity(LLMC_HEADER_BYTES);
    std::fs::File::open(path)
        .and_then(|f| f.take(LLMC_HEADER_BYTES as u64).read_to_end(&mut head))
        .map_err(io)?;
    identify(&head, meta.len()).map_err(|detail| DataError::Shard {
        path: path.to_path_buf(),
        offset: 0,
        detail,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llmc(kind: LlmcHeader, count: i32) -> Vec<u8> {
        let mut h = vec![0u8; LLMC_HEADER_BYTES];
        h[..4].copy_from_slice(&kind.magic.to_le_bytes());
        h[4..8].copy_from_slice(&kind.version.to_le_bytes());
        h[8..12].copy_from_slice(&count.to_le_bytes());
        h
    }

    #[test]
    fn known_headers_and_raw_ids_are_told_apart() {
        assert_eq!(
            identify(&llmc(LLMC_GPT2, 10), 1044),
            Ok(TokenHeader::Llmc(IdWidth::U16))
        );
        assert_eq!(
            identify(&llmc(LLMC_LLAMA3, 10), 1064),
            Ok(TokenHeader::Llmc(IdWidth::U32))
        );
        assert_eq!(
            identify(b"OXFTOK16\x00\x01\x00\x00", 12),
            Ok(TokenHeader::Pretokenized(IdWidth::U16))
        );
        assert_eq!(
            identify(b"OXFTOK32\x00\x00\x02\x00", 12),
            Ok(TokenHeader::Pretokenized(IdWidth::U32))
        );
        let raw: Vec<u8> = (0..512u16)
            .flat_map(|i| (i * 97 % 50257).to_le_bytes())
            .collect();
        assert_eq!(identify(&raw, 1024), Ok(TokenHeader::None));
        assert_eq!(identify(b"hello world, a text", 19), Ok(TokenHeader::None));
        assert_eq!(identify(&[1, 2], 2), Ok(TokenHeader::None));
    }

    #[test]
    fn every_single_bit_flip_of_a_magic_is_damage_naming_the_field() {
        for kind in [LLMC_GPT2, LLMC_LLAMA3] {
            let len = 1024 + 10 * kind.width.bytes() as u64;
            for bit in 0..32 {
                let mut h = llmc(kind, 10);
                h[bit / 8] ^= 1 << (bit % 8);
                let e = identify(&h, len).unwrap_err();
                let from = format!("1 bit(s) away from llm.c's {}", kind.magic);
                assert!(e.contains("magic (bytes 0..4)") && e.contains(&from), "{e}");
                // Without the rest of the header, one bit away is still damage.
                let e = identify(&h[..8], 8).unwrap_err();
                assert!(e.contains("llm.c"), "{e}");
            }
        }
        for magic in [PRETOKENIZED_MAGIC, PRETOKENIZED32_MAGIC] {
            for bit in 0..64 {
                let mut h = magic.to_vec();
                h.extend([0, 1, 0, 0]);
                h[bit / 8] ^= 1 << (bit % 8);
                match identify(&h, 12) {
                    // OXFTOK16 and OXFTOK32 are two bits apart: no single flip makes one the
                    // other.
                    Ok(k) => panic!("{:?} read as {k:?}", String::from_utf8_lossy(&h)),
                    Err(e) => assert!(e.contains("magic (bytes 0..8)"), "{e}"),
                }
            }
        }
        // A magic far off in an llm.c header (version and reserved zeros intact).
        for kind in [LLMC_GPT2, LLMC_LLAMA3] {
            let mut h = llmc(kind, 10);
            h[..4].copy_from_slice(&0x0badf00d_i32.to_le_bytes());
            assert!(identify(&h, 1044).is_err());
        }
    }

    #[test]
    fn widths_round_trip_and_refuse_what_does_not_fit() {
        let ids = [0u32, 1, 65535, 65536, u32::MAX];
        let mut b = Vec::new();
        IdWidth::U32.encode_into(&ids, &mut b).unwrap();
        assert_eq!(IdWidth::U32.decode(&b).collect::<Vec<_>>(), ids);
        let mut b = Vec::new();
        assert_eq!(IdWidth::U16.encode_into(&ids, &mut b), Err((3, 65536)));
        let mut b = Vec::new();
        IdWidth::U16.encode_into(&ids[..3], &mut b).unwrap();
        assert_eq!(b, [0, 0, 1, 0, 255, 255]);
        assert_eq!(IdWidth::for_vocab(65536), IdWidth::U16);
        assert_eq!(IdWidth::for_vocab(65537), IdWidth::U32);
    }
}
