//! What a token file is, by its first bytes: an llm.c shard (a header of 256 little-endian
//! i32: magic 20240520, version, token count, then zeros), a pre-tokenized file (`OXFTOK16`), or
//! neither (nanoGPT's raw ids, or text). A header a few bits away from a known magic, or an
//! llm.c header (its reserved words zero) whose magic is not llm.c's, is damaged: refused,
//! naming the field, rather than read as tokens or text.

use std::io::Read;
use std::path::Path;

use super::corpus::PRETOKENIZED_MAGIC;
use super::error::DataError;
use super::shards::{LLMC_HEADER_BYTES, LLMC_MAGIC, LLMC_VERSION};

/// The kinds of token file a header names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenHeader {
    /// llm.c's header (its magic exact; version and count are checked by the reader).
    Llmc,
    /// `OXFTOK16`, the vocabulary size, u16 ids.
    Pretokenized,
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
    let magic = LLMC_MAGIC.to_le_bytes();
    let word = |i: usize| -> Option<i32> {
        head.get(4 * i..4 * i + 4)
            .and_then(|b| b.try_into().ok())
            .map(i32::from_le_bytes)
    };
    if head.starts_with(&magic) {
        return Ok(TokenHeader::Llmc);
    }
    if head.starts_with(&PRETOKENIZED_MAGIC[..]) {
        return Ok(TokenHeader::Pretokenized);
    }
    if head.len() >= 8 {
        let apart = bits_apart(&head[..8], PRETOKENIZED_MAGIC);
        if apart <= NEAR {
            return Err(format!(
                "damaged pre-tokenized header: its magic (bytes 0..8) reads {:?}, {apart} bit(s) \
                 away from \"OXFTOK16\"",
                String::from_utf8_lossy(&head[..8])
            ));
        }
    }
    let Some(first) = word(0) else {
        return Ok(TokenHeader::None);
    };
    let apart = bits_apart(&head[..4], &magic);
    let reserved_zero =
        head.len() >= LLMC_HEADER_BYTES && head[12..LLMC_HEADER_BYTES].iter().all(|&b| b == 0);
    let version_like = word(1) == Some(LLMC_VERSION);
    let count_like =
        word(2).is_some_and(|c| c >= 0 && LLMC_HEADER_BYTES as u64 + 2 * c as u64 == len);
    let llmc_like = reserved_zero && (version_like || count_like || apart <= NEAR_IN_HEADER);
    if apart <= NEAR || llmc_like {
        return Err(format!(
            "damaged llm.c header: its magic (bytes 0..4) is {first}, {apart} bit(s) away from \
             llm.c's {LLMC_MAGIC}"
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

    fn llmc(count: i32) -> Vec<u8> {
        let mut h = vec![0u8; LLMC_HEADER_BYTES];
        h[..4].copy_from_slice(&LLMC_MAGIC.to_le_bytes());
        h[4..8].copy_from_slice(&LLMC_VERSION.to_le_bytes());
        h[8..12].copy_from_slice(&count.to_le_bytes());
        h
    }

    #[test]
    fn known_headers_and_raw_ids_are_told_apart() {
        assert_eq!(identify(&llmc(10), 1044), Ok(TokenHeader::Llmc));
        assert_eq!(
            identify(b"OXFTOK16\x00\x01\x00\x00", 12),
            Ok(TokenHeader::Pretokenized)
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
        for bit in 0..32 {
            let mut h = llmc(10);
            h[bit / 8] ^= 1 << (bit % 8);
            let e = identify(&h, 1044).unwrap_err();
            assert!(
                e.contains("magic (bytes 0..4)") && e.contains("1 bit(s)"),
                "{e}"
            );
            // Without the rest of the header, one bit away is still damage.
            let e = identify(&h[..8], 8).unwrap_err();
            assert!(e.contains("llm.c"), "{e}");
        }
        for bit in 0..64 {
            let mut h = b"OXFTOK16\x00\x01\x00\x00".to_vec();
            h[bit / 8] ^= 1 << (bit % 8);
            let e = identify(&h, 12).unwrap_err();
            assert!(e.contains("magic (bytes 0..8)"), "{e}");
        }
        // A magic far off in an llm.c header (version and reserved zeros intact).
        let mut h = llmc(10);
        h[..4].copy_from_slice(&0x0badf00d_i32.to_le_bytes());
        assert!(identify(&h, 1044).is_err());
    }
}
