//! What a manifest file may cost to read, checked before it is parsed: how deep it nests and
//! how many nodes it has; and, from the same pass, where each node is ([`Layout`]), so that
//! every error, warning and quoted mode of the file is located without parsing it again (a
//! file of 4,000 warnings cost 4,000 parses when each was located by a parse of its own).
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

/// Where the nodes of a file's documents are (1-based line and column of each node's start),
/// and the text of its map keys and quoted scalars; `None` documents where the event parser
/// could not read the file.
#[derive(Debug, Default)]
pub(crate) struct Layout {
    documents: Option<Vec<Node>>,
}

/// One node of a document.
#[derive(Debug)]
enum Node {
    /// A scalar: its text if it is a map's key or quoted, and whether it is quoted.
    Scalar {
        at: (u32, u32),
        text: Option<Box<str>>,
        quoted: bool,
    },
    Seq {
        at: (u32, u32),
        items: Vec<Node>,
    },
    /// A map: its keys and values, in order (a key that is not a scalar has no text).
    Map {
        at: (u32, u32),
        entries: Vec<(Option<Box<str>>, Node)>,
    },
    /// An alias: what it stands for is not followed.
    Alias {
        at: (u32, u32),
    },
}

impl Node {
    fn at(&self) -> (usize, usize) {
        let (Node::Scalar { at, .. }
        | Node::Seq { at, .. }
        | Node::Map { at, .. }
        | Node::Alias { at }) = self;
        (at.0 as usize, at.1 as usize)
    }
}

/// A collection being read.
enum Open {
    Seq((u32, u32), Vec<Node>),
    /// Its entries, and the key read whose value comes next.
    Map(
        (u32, u32),
        Vec<(Option<Box<str>>, Node)>,
        Option<Option<Box<str>>>,
    ),
}

impl Layout {
    /// The line and column of the node that `steps` lead to in document `document` (0-based);
    /// `None` when they lead nowhere in the text (through a merge key or an alias, say).
    pub(crate) fn find(
        &self,
        document: usize,
        steps: &[super::locate::Step],
    ) -> Option<(usize, usize)> {
        use super::locate::Step;
        let mut node = self.documents.as_ref()?.get(document)?;
        for step in steps {
            node = match (node, step) {
                (Node::Map { entries, .. }, Step::Key(k)) => {
                    &entries
                        .iter()
                        .find(|(key, _)| key.as_deref() == Some(k.as_str()))?
                        .1
                }
                (Node::Seq { items, .. }, Step::Index(i)) => items.get(*i)?,
                _ => return None,
            };
        }
        Some(node.at())
    }

    /// Whether the layout has document `document` (0-based).
    pub(crate) fn has(&self, document: usize) -> bool {
        self.documents.as_ref().is_some_and(|d| document < d.len())
    }

    /// Whether the layout has document `document`, read as a map (a Kubernetes object).
    pub(crate) fn is_map(&self, document: usize) -> bool {
        self.documents
            .as_ref()
            .and_then(|d| d.get(document))
            .is_some_and(|n| matches!(n, Node::Map { .. }))
    }

    /// The mode fields (`defaultMode`, `mode`) of document `document` whose value is a quoted
    /// string: path (`spec.volumes[0].secret.defaultMode`), value, line and column of the
    /// quote. The API's modes are integers: only a plain `0644` is the YAML 1.1 octal number
    /// Kubernetes reads; a quoted one is a string it refuses.
    pub(crate) fn quoted_modes(&self, document: usize) -> Vec<(String, String, (usize, usize))> {
        let mut found = Vec::new();
        let Some(root) = self.documents.as_ref().and_then(|d| d.get(document)) else {
            return found;
        };
        // An explicit stack (the depth is bounded by the check, but a file chooses it).
        let mut stack = vec![(String::new(), root, false)];
        while let Some((path, node, is_mode)) = stack.pop() {
            match node {
                Node::Scalar {
                    text: Some(text),
                    quoted: true,
                    ..
                } if is_mode => found.push((path, text.to_string(), node.at())),
                Node::Map { entries, .. } => {
                    for (key, value) in entries.iter().rev() {
                        let key = key.as_deref().unwrap_or_default();
                        let path = match path.is_empty() {
                            true => key.to_string(),
                            false => format!("{path}.{key}"),
                        };
                        stack.push((path, value, key == "defaultMode" || key == "mode"));
                    }
                }
                Node::Seq { items, .. } => {
                    for (i, item) in items.iter().enumerate().rev() {
                        stack.push((format!("{path}[{i}]"), item, false));
                    }
                }
                _ => {}
            }
        }
        found
    }
}

/// Adds a finished node to the collection being read, or as a document.
fn attach(open: &mut [Open], documents: &mut Vec<Node>, node: Node) {
    match open.last_mut() {
        None => documents.push(node),
        Some(Open::Seq(_, items)) => items.push(node),
        Some(Open::Map(_, entries, key)) => match key.take() {
            Some(k) => entries.push((k, node)),
            None => {
                *key = Some(match node {
                    Node::Scalar { text, .. } => text,
                    _ => None,
                })
            }
        },
    }
}

/// Checks that `text` nests at most [`MAX_NESTING`] levels and has at most [`MAX_NODES`]
/// nodes, and returns where its nodes are. Time and memory are linear in the length of `text`.
pub(crate) fn check(text: &str) -> Result<Layout, TooCostly> {
    let options = granit_parser::options! {
        flow_nesting_limit: MAX_NESTING,
        block_nesting_limit: MAX_NESTING,
    };
    let mut nodes = 0usize;
    let mut documents = Vec::new();
    let mut open: Vec<Open> = Vec::new();
    for next in Parser::new_from_str_with_options(text, options) {
        let (event, span) = match next {
            Ok(e) => e,
            Err(e) => return check_unparsed(text, &e).map(|()| Layout::default()),
        };
        let at = (
            u32::try_from(span.start.line()).unwrap_or(u32::MAX),
            u32::try_from(span.start.col() + 1).unwrap_or(u32::MAX),
        );
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
        match event {
            Event::Scalar(value, style, ..) => {
                let quoted = matches!(
                    style,
                    granit_parser::ScalarStyle::SingleQuoted
                        | granit_parser::ScalarStyle::DoubleQuoted
                );
                let is_key = matches!(open.last(), Some(Open::Map(_, _, None)));
                let text = (is_key || quoted).then(|| Box::from(&*value));
                attach(&mut open, &mut documents, Node::Scalar { at, text, quoted });
            }
            Event::Alias(..) | Event::UnresolvedAlias(..) => {
                attach(&mut open, &mut documents, Node::Alias { at });
            }
            Event::SequenceStart(..) => open.push(Open::Seq(at, Vec::new())),
            Event::MappingStart(..) => open.push(Open::Map(at, Vec::new(), None)),
            Event::SequenceEnd | Event::MappingEnd => {
                let node = match open.pop() {
                    Some(Open::Seq(at, items)) => Node::Seq { at, items },
                    Some(Open::Map(at, entries, _)) => Node::Map { at, entries },
                    None => continue,
                };
                attach(&mut open, &mut documents, node);
            }
            _ => {}
        }
    }
    Ok(Layout {
        documents: Some(documents),
    })
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
            assert!(check(text).is_ok(), "{text}");
        }
        let deep_enough = format!("x: {}{}", "[".repeat(100), "]".repeat(100));
        assert!(check(&deep_enough).is_ok());
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
