//! A Rust source as the tokens the import graph reads: identifiers (keywords included) and
//! punctuation, with comments, string and character literals, numbers and lifetimes dropped.

/// One token: an identifier or keyword, `::`, or one other punctuation character.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tok {
    Ident(String),
    PathSep,
    Punct(char),
}

impl Tok {
    /// The identifier, if this is one.
    pub fn ident(&self) -> Option<&str> {
        match self {
            Tok::Ident(s) => Some(s),
            _ => None,
        }
    }
    /// Whether this is the identifier or keyword `word`.
    pub fn is(&self, word: &str) -> bool {
        self.ident() == Some(word)
    }
}

/// The tokens of `src`.
pub fn tokens(src: &str) -> Vec<Tok> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && c.get(i + 1) == Some(&'*') {
            i = skip_block_comment(&c, i);
        } else if ch == '"' {
            i = skip_string(&c, i + 1);
        } else if (ch == 'r' || ch == 'b' || ch == 'c') && raw_or_byte_string(&c, i).is_some() {
            i = raw_or_byte_string(&c, i).unwrap_or(i + 1);
        } else if ch == '\'' {
            i = skip_char_or_lifetime(&c, i);
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            // `r#ident` is the identifier itself.
            if word == "r" && c.get(i) == Some(&'#') {
                i += 1;
                continue;
            }
            out.push(Tok::Ident(word));
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_' || c[i] == '.') {
                // `0..n`: a range, not a fraction.
                if c[i] == '.' && c.get(i + 1) == Some(&'.') {
                    break;
                }
                i += 1;
            }
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push(Tok::PathSep);
            i += 2;
        } else {
            out.push(Tok::Punct(ch));
            i += 1;
        }
    }
    out
}

/// The index after the (nested) block comment starting at `i`.
fn skip_block_comment(c: &[char], mut i: usize) -> usize {
    let mut depth = 0usize;
    while i < c.len() {
        if c[i] == '/' && c.get(i + 1) == Some(&'*') {
            depth += 1;
            i += 2;
        } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    i
}

/// The index after the string whose body starts at `i` (escapes honoured).
fn skip_string(c: &[char], mut i: usize) -> usize {
    while i < c.len() {
        match c[i] {
            '\\' => i += 2,
            '"' => return i + 1,
            _ => i += 1,
        }
    }
    i
}

/// The index after a raw, byte or C string (`r"…"`, `r#"…"#`, `b"…"`, `br"…"`, `c"…"`) or
/// byte character (`b'x'`) starting at `i`; None when `i` starts none of them.
fn raw_or_byte_string(c: &[char], i: usize) -> Option<usize> {
    let mut j = i;
    if matches!(c.get(j), Some('b' | 'c')) {
        j += 1;
    }
    let raw = c.get(j) == Some(&'r');
    if raw {
        j += 1;
    }
    if j == i {
        return None;
    }
    // An identifier character before: part of a longer identifier.
    if i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_') {
        return None;
    }
    if !raw {
        return match c.get(j) {
            Some('"') => Some(skip_string(c, j + 1)),
            Some('\'') if c[i] == 'b' && j == i + 1 => Some(skip_char_or_lifetime(c, j)),
            _ => None,
        };
    }
    let mut hashes = 0;
    while c.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    if c.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < c.len() {
        if c[j] == '"' && (0..hashes).all(|k| c.get(j + 1 + k) == Some(&'#')) {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(j)
}

/// The index after a character literal (`'x'`, `'\n'`, `'\u{..}'`) or a lifetime (`'a`)
/// starting at `i`.
fn skip_char_or_lifetime(c: &[char], i: usize) -> usize {
    if c.get(i + 1) == Some(&'\\') {
        // Past the backslash and the escaped character (which may be a quote).
        let mut j = i + 3;
        while j < c.len() && c[j] != '\'' {
            j += 1;
        }
        return j + 1;
    }
    if c.get(i + 2) == Some(&'\'') {
        return i + 3;
    }
    // A lifetime: skip the quote; the name lexes as an identifier nobody reads as a path.
    i + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idents(src: &str) -> Vec<String> {
        tokens(src)
            .iter()
            .filter_map(|t| t.ident().map(String::from))
            .collect()
    }

    #[test]
    fn comments_strings_and_chars_are_dropped() {
        let src = r####"
            // use crate::hid_a;
            /* use crate::hid_b; /* nested */ use crate::hid_c; */
            let s = "use crate::hid_d; \" still";
            let r = r#"use crate::hid_e;"#;
            let b = b"crate::hid_f";
            let ch = '"';
            let q = '\'';
            fn f<'a>(x: &'a str) {}
            use crate::g;
        "####;
        let words = idents(src);
        for hidden in ["hid_a", "hid_b", "hid_c", "hid_d", "hid_e", "hid_f"] {
            assert!(!words.contains(&hidden.to_string()), "{hidden} leaked");
        }
        assert!(words.ends_with(&["use".into(), "crate".into(), "g".into()]));
    }

    #[test]
    fn paths_keep_their_separators() {
        let t = tokens("crate::x::{y, z}");
        assert_eq!(t[1], Tok::PathSep);
        assert_eq!(t[3], Tok::PathSep);
        assert_eq!(t[4], Tok::Punct('{'));
    }
}
