//! What one source file says about modules: the `mod` items it declares (files and inline
//! blocks), its `use` trees flattened into paths, the other `crate::`/`super::`/`self::` paths
//! it names, and the names of the items it defines.

use std::collections::HashSet;

use crate::lex::Tok;

/// One path a file names, as written, with the inline module it sits in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Named {
    /// Segments as written (`crate`, `super`, `self` or a first name, then names).
    pub segments: Vec<String>,
    /// The path ends in `*` (a glob import).
    pub glob: bool,
    /// The name it is imported under (`use` only; the last segment unless renamed).
    pub alias: Option<String>,
    /// Inline modules (`mod x { .. }`) around it, outermost first.
    pub inline: Vec<String>,
    /// Written in a `use` item (else a path in code).
    pub is_use: bool,
    /// Written in a `pub` (or `pub(..)`) `use` item: a re-export.
    pub public: bool,
}

/// What one file declares, imports and defines.
#[derive(Clone, Debug, Default)]
pub struct FileFacts {
    /// `mod x;` items at the file's top level: child modules in files.
    pub file_mods: Vec<String>,
    /// `mod x { .. }` blocks at the file's top level.
    pub inline_mods: Vec<String>,
    /// Every path the file names.
    pub named: Vec<Named>,
    /// Items the file defines at its top level (functions, types, traits, constants, macros).
    pub defines: Vec<String>,
    /// Identifiers the file names outside its `use` items.
    pub mentions: HashSet<String>,
}

const ITEM_KEYWORDS: [&str; 9] = [
    "fn",
    "struct",
    "enum",
    "trait",
    "type",
    "const",
    "static",
    "union",
    "macro_rules",
];

/// The facts of a file given its tokens.
pub fn facts(toks: &[Tok]) -> FileFacts {
    let mut f = FileFacts::default();
    // Open braces, and the inline modules among them (name, depth of its brace).
    let mut depth = 0usize;
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let t = &toks[i];
        match t {
            Tok::Punct('{') => {
                depth += 1;
                i += 1;
            }
            Tok::Punct('}') => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
            }
            Tok::Ident(w) if w == "mod" => {
                let name = toks.get(i + 1).and_then(Tok::ident).map(String::from);
                match (name, toks.get(i + 2)) {
                    (Some(n), Some(Tok::Punct(';'))) => {
                        if depth == 0 {
                            f.file_mods.push(n);
                        }
                        i += 3;
                    }
                    (Some(n), Some(Tok::Punct('{'))) => {
                        if depth == 0 {
                            f.inline_mods.push(n.clone());
                        }
                        depth += 1;
                        inline.push((n, depth));
                        i += 3;
                    }
                    _ => i += 1,
                }
            }
            Tok::Ident(w) if w == "use" && !prev_is_path(toks, i) => {
                let around: Vec<String> = inline.iter().map(|(n, _)| n.clone()).collect();
                let public = is_pub(toks, i);
                let mut paths = Vec::new();
                i = use_tree(toks, i + 1, &[], &mut paths);
                for (segments, glob, alias) in paths {
                    f.named.push(Named {
                        segments,
                        glob,
                        alias,
                        inline: around.clone(),
                        is_use: true,
                        public,
                    });
                }
                // The `;` ending the item.
                i += 1;
            }
            Tok::Ident(w)
                if (w == "crate" || w == "super" || w == "self")
                    && matches!(toks.get(i + 1), Some(Tok::PathSep))
                    && !prev_is_path(toks, i) =>
            {
                let mut segments = vec![w.clone()];
                let mut j = i + 1;
                while let (Some(Tok::PathSep), Some(Tok::Ident(n))) = (toks.get(j), toks.get(j + 1))
                {
                    segments.push(n.clone());
                    j += 2;
                }
                f.named.push(Named {
                    segments,
                    glob: false,
                    alias: None,
                    inline: inline.iter().map(|(n, _)| n.clone()).collect(),
                    is_use: false,
                    public: false,
                });
                i = j;
            }
            Tok::Ident(w) if depth == 0 && ITEM_KEYWORDS.contains(&w.as_str()) => {
                let mut j = i + 1;
                if w == "macro_rules" && matches!(toks.get(j), Some(Tok::Punct('!'))) {
                    j += 1;
                }
                if let Some(n) = toks.get(j).and_then(Tok::ident) {
                    f.defines.push(n.to_string());
                }
                i = j;
            }
            Tok::Ident(w) => {
                f.mentions.insert(w.clone());
                i += 1;
            }
            _ => i += 1,
        }
    }
    f
}

/// Whether token `i` continues a path (`x::use` never happens, but `x::crate` in macros and
/// `$crate::` do): then it starts no path of its own.
fn prev_is_path(toks: &[Tok], i: usize) -> bool {
    i > 0 && matches!(toks[i - 1], Tok::PathSep | Tok::Punct('$'))
}

/// Whether the `use` at token `i` is `pub` or `pub(..)`.
fn is_pub(toks: &[Tok], i: usize) -> bool {
    match i.checked_sub(1).map(|k| &toks[k]) {
        Some(t) if t.is("pub") => true,
        Some(Tok::Punct(')')) => {
            let open = toks[..i].iter().rposition(|t| *t == Tok::Punct('('));
            open.is_some_and(|o| o > 0 && toks[o - 1].is("pub"))
        }
        _ => false,
    }
}

/// A flattened use path: segments, glob, alias.
type UsePath = (Vec<String>, bool, Option<String>);

/// Parses the use tree starting at `i` under `prefix` into `out`; returns the index of the
/// token that ends it (`;`, `,` or `}` of the enclosing group).
fn use_tree(toks: &[Tok], mut i: usize, prefix: &[String], out: &mut Vec<UsePath>) -> usize {
    let mut segs: Vec<String> = prefix.to_vec();
    // A leading `::` (an extern path) adds nothing.
    if matches!(toks.get(i), Some(Tok::PathSep)) {
        i += 1;
    }
    loop {
        match toks.get(i) {
            Some(Tok::Punct('{')) => {
                i += 1;
                loop {
                    match toks.get(i) {
                        Some(Tok::Punct('}')) => return i + 1,
                        Some(Tok::Punct(',')) => i += 1,
                        None => return i,
                        _ => i = use_tree(toks, i, &segs, out),
                    }
                }
            }
            Some(Tok::Punct('*')) => {
                out.push((segs, true, None));
                return i + 1;
            }
            Some(Tok::Ident(n)) => {
                let n = n.clone();
                i += 1;
                if matches!(toks.get(i), Some(Tok::PathSep)) {
                    segs.push(n);
                    i += 1;
                    continue;
                }
                // `self` in a group names the prefix itself.
                let alias_default = if n == "self" {
                    segs.last().cloned()
                } else {
                    segs.push(n.clone());
                    Some(n)
                };
                let alias = if toks.get(i).is_some_and(|t| t.is("as")) {
                    i += 1;
                    let a = toks.get(i).and_then(Tok::ident).map(String::from);
                    i += 1;
                    a
                } else {
                    alias_default
                };
                out.push((segs, false, alias));
                return i;
            }
            _ => return i,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lex::tokens;

    fn uses(src: &str) -> Vec<(String, bool, Option<String>)> {
        facts(&tokens(src))
            .named
            .into_iter()
            .filter(|n| n.is_use)
            .map(|n| (n.segments.join("::"), n.glob, n.alias))
            .collect()
    }

    #[test]
    fn use_trees_flatten() {
        let got = uses(
            "use crate::a::{self, b::{C, D as E}, f::*};\npub(crate) use super::g;\nuse std::fmt;",
        );
        let want = vec![
            ("crate::a".to_string(), false, Some("a".to_string())),
            ("crate::a::b::C".into(), false, Some("C".into())),
            ("crate::a::b::D".into(), false, Some("E".into())),
            ("crate::a::f".into(), true, None),
            ("super::g".into(), false, Some("g".into())),
            ("std::fmt".into(), false, Some("fmt".into())),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn mods_inline_blocks_and_items() {
        let f = facts(&tokens(
            "mod a;\npub(crate) mod b;\n#[cfg(test)]\nmod tests {\n use super::*;\n fn inner() {}\n}\n\
             pub struct S;\nfn g() { crate::c::d(); }\nmacro_rules! m { () => {} }",
        ));
        assert_eq!(f.file_mods, ["a", "b"]);
        assert_eq!(f.inline_mods, ["tests"]);
        assert_eq!(f.defines, ["S", "g", "m"]);
        let glob = &f.named[0];
        assert_eq!(
            (glob.glob, glob.inline.clone()),
            (true, vec!["tests".into()])
        );
        let call = &f.named[1];
        assert_eq!(call.segments, ["crate", "c", "d"]);
        assert!(call.inline.is_empty() && !call.is_use);
    }
}
