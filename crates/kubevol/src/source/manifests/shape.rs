//! What a manifest file may cost to read, checked before it is parsed: how deep it nests and
//! how many nodes it has.
//!
//! The YAML parser behind the manifests (libyaml) is quadratic in the depth of flow
//! collections (`x: [[[[…`: 20,000 levels take half a second, 200,000 minutes) and refuses what
//! nests deeper than 128 levels only after it has read it all. So a file first goes through a
//! pure-Rust event parser that stops at [`MAX_NESTING`] levels (flow and block alike) and at
//! [`MAX_NODES`] nodes, in one pass whose cost is linear in the file's size. Where that parser
//! cannot read the file at all (a construct it takes differently), a cruder count stands in:
//! brackets outside any context, an over-estimate of the depth, and the bytes that can end a
//! node, an over-estimate of the nodes.

use granit_parser::{Event, Parser, ScanError};

/// The deepest a manifest may nest: what the YAML and JSON deserializers read (their recursion
/// limit), and far beyond any Kubernetes object.
pub const MAX_NESTING: usize = 128;

/// The most nodes (scalars, sequences, mappings, aliases) one manifest file may have: about
/// 1,000 pods in one file, or a ConfigMap of 100,000 keys.
pub const MAX_NODES: usize = 250_000;

/// Why a file is not parsed, and where (1-based line and column).
#[derive(Debug, PartialEq, Eq)]
pub struct TooCostly {
    /// Where the limit was crossed.
    pub line: usize,
    /// The column there.
    pub column: usize,
    /// What to change, in words.
    pub message: String,
}

fn too_deep(line: usize, column: usize) -> TooCostly {
    TooCostly {
        line,
        column,
        message: format!(
            "nests more than {MAX_NESTING} levels deep: kubevol reads manifests nested at most {MAX_NESTING} levels (no Kubernetes object comes near it); fix the file"
        ),
    }
}

fn too_many(line: usize, column: usize) -> TooCostly {
    TooCostly {
        line,
        column,
        message: format!(
            "has more than {MAX_NODES} YAML nodes: kubevol reads at most {MAX_NODES} in one file; split it into several files"
        ),
    }
}

/// Checks that `text` nests at most [`MAX_NESTING`] levels and has at most [`MAX_NODES`]
/// nodes. Time and memory are linear in the length of `text`.
pub fn check(text: &str) -> Result<(), TooCostly> {
    let options = granit_parser::options! {
        flow_nesting_limit: MAX_NESTING,
        block_nesting_limit: MAX_NESTING,
    };
    let mut nodes = 0usize;
    for next in Parser::new_from_str_with_options(text, options) {
        match next {
            Ok((event, span)) => {
                let node = matches!(
                    event,
                    Event::Scalar(..)
                        | Event::SequenceStart(..)
                        | Event::MappingStart(..)
                        | Event::Alias(..)
                        | Event::UnresolvedAlias(..)
                );
                nodes += usize::from(node);
                if nodes > MAX_NODES {
                    return Err(too_many(span.start.line(), span.start.col() + 1));
                }
            }
            Err(e) => return check_unparsed(text, &e),
        }
    }
    Ok(())
}

/// The check for a file the event parser could not read: `e` ends its pass.
fn check_unparsed(text: &str, e: &ScanError) -> Result<(), TooCostly> {
    if matches!(e.kind(), granit_parser::ErrorKind::RecursionLimitExceeded) {
        return Err(too_deep(e.marker().line(), e.marker().col() + 1));
    }
    let (mut line, mut column) = (1, 0);
    let (mut depth, mut ends) = (0usize, 0usize);
    for b in text.bytes() {
        // Columns count characters, not the bytes that continue one.
        if b & 0xC0 != 0x80 {
            column += 1;
        }
        match b {
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_NESTING {
                    return Err(too_deep(line, column));
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        if matches!(b, b',' | b':' | b'-' | b'\n' | b'[' | b'{') {
            ends += 1;
            if ends > 4 * MAX_NODES {
                return Err(too_many(line, column));
            }
        }
        if b == b'\n' {
            line += 1;
            column = 0;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordinary_manifests_pass() {
        for text in [
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\nspec:\n  containers: [{name: c, image: i}]\n",
            "{\"apiVersion\": \"v1\", \"kind\": \"ConfigMap\", \"data\": {\"a\": \"[[[[\"}}",
            "a: |\n  [[[[[[[[\n---\nb: '{{{{'\n",
            "",
        ] {
            assert_eq!(check(text), Ok(()), "{text}");
        }
        let deep_enough = format!("x: {}{}", "[".repeat(100), "]".repeat(100));
        assert_eq!(check(&deep_enough), Ok(()));
    }

    #[test]
    fn deep_nesting_is_refused_where_it_crosses_the_limit() {
        let flow = format!("x: {}", "[".repeat(200_000));
        let e = check(&flow).unwrap_err();
        assert_eq!(e.line, 1);
        assert!(e.column <= MAX_NESTING + 4, "{e:?}");
        assert!(e.message.contains("128 levels"), "{}", e.message);
        let block: String = (0..200).map(|i| format!("{}k:\n", " ".repeat(i))).collect();
        assert!(check(&block).unwrap_err().message.contains("nests more"));
        let json = format!("{}1{}", "{\"a\":".repeat(5_000), "}".repeat(5_000));
        assert!(check(&json).unwrap_err().message.contains("nests more"));
        // A file the event parser cannot read is still held to the limit.
        let broken = format!("a: b\n\tc: [{}", "[".repeat(10_000));
        let e = check(&broken).unwrap_err();
        assert_eq!(
            (e.line, e.message.contains("nests more")),
            (2, true),
            "{e:?}"
        );
    }

    #[test]
    fn too_many_nodes_are_refused() {
        let many = format!("x: [{}]", "a,".repeat(MAX_NODES + 10));
        assert!(check(&many).unwrap_err().message.contains("split it"));
    }

    /// YAML made of the tokens that nest, quote and end nodes, in any order: the check and the
    /// parse behind it end, with objects or errors that name the file, never a panic.
    #[test]
    fn any_token_soup_is_checked_and_parsed_or_refused() {
        use proptest::prelude::*;
        let token = prop::sample::select(vec![
            "[",
            "]",
            "{",
            "}",
            ",",
            ":",
            " ",
            "\n",
            "- ",
            "'",
            "\"",
            "#",
            "|",
            ">",
            "&a",
            "*a",
            "!t",
            "a",
            "kind: Pod",
            "apiVersion: v1",
            "---\n",
            "\t",
            "? ",
            "\\",
            "%YAML 1.2\n",
        ]);
        let soup = prop::collection::vec(token, 0..200).prop_map(|t| t.concat());
        proptest!(|(text in soup)| {
            let _ = check(&text);
            let path = std::path::Path::new("/m/soup.yaml");
            let (_, errors) = super::super::parse_manifest(path, &text);
            for e in errors {
                prop_assert_eq!(e.path.as_path(), path);
            }
        });
        proptest!(|(text in any::<String>())| {
            let _ = check(&text);
            let _ = super::super::parse_manifest(std::path::Path::new("/m/any.json"), &text);
        });
    }
}
