//! `ByteTokenizer`: one token per byte (vocabulary 256), so any text encodes and every id
//! sequence decodes (invalid UTF-8 is shown with replacement characters).

/// The byte-level tokenizer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    /// Number of token ids.
    pub const VOCAB: usize = 256;

    /// The ids of `text`'s bytes.
    pub fn encode(&self, text: &str) -> Vec<u16> {
        text.bytes().map(u16::from).collect()
    }

    /// The text of `ids`; ids above 255 (from a pre-tokenized corpus with a larger vocabulary)
    /// print as `<id>`.
    pub fn decode(&self, ids: &[u16]) -> String {
        let mut out = String::new();
        let mut bytes = Vec::new();
        for &id in ids {
            match u8::try_from(id) {
                Ok(b) => bytes.push(b),
                Err(_) => {
                    out.push_str(&String::from_utf8_lossy(&bytes));
                    bytes.clear();
                    out.push_str(&format!("<{id}>"));
                }
            }
        }
        out.push_str(&String::from_utf8_lossy(&bytes));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn decode_inverts_encode(s in ".{0,64}") {
            let t = ByteTokenizer;
            prop_assert_eq!(t.decode(&t.encode(&s)), s);
        }
    }

    #[test]
    fn large_ids_are_shown_by_number() {
        assert_eq!(ByteTokenizer.decode(&[104, 300, 105]), "h<300>i");
    }
}
