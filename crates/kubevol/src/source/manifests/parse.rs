//! Parsing manifest files: multi-document YAML and JSON into Kubernetes objects, with every
//! error located by file, document, line and column, and worded for the user (a Secret's
//! values are never quoted).

use kubevol_core::snapshot::{VolumeSnapshot, VolumeSnapshotContent};
use std::path::Path;

use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, PersistentVolumeClaim, Pod, Secret};
use k8s_openapi::api::storage::v1::{CSIDriver, StorageClass};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use tracing::debug;

use super::locate::{line_column, locate, quoted_modes, steps, Step};
use super::shape::Layout;
use crate::source::extensions::pod_extensions;
use crate::source::unknown::unknown_fields;
use crate::store::{
    normalize_pod, normalize_secret, ManifestError, Object, ObjectName, DEFAULT_NAMESPACE,
};

pub(crate) fn manifest_error(
    path: &Path,
    document: Option<usize>,
    loc: Option<(usize, usize)>,
    message: String,
) -> ManifestError {
    ManifestError {
        path: path.to_path_buf(),
        document,
        line: loc.map(|l| l.0),
        column: loc.map(|l| l.1),
        message,
        object: None,
    }
}

/// The kind, namespace and name a document states, for an error that keeps it from loading.
fn object_name(kind: &str, value: &serde_json::Value) -> Option<ObjectName> {
    let meta = value.get("metadata")?;
    let text = |k: &str| {
        meta.get(k)
            .and_then(|v| v.as_str())
            .filter(|v| !v.is_empty())
    };
    let cluster_scoped = matches!(kind, "PersistentVolume" | "CSIDriver" | "StorageClass");
    Some(ObjectName {
        kind: kind.to_string(),
        namespace: if cluster_scoped {
            String::new()
        } else {
            text("namespace").unwrap_or(DEFAULT_NAMESPACE).to_string()
        },
        name: text("name")?.to_string(),
    })
}

/// A YAML error's message without the location suffix serde adds (the location is reported in
/// its own fields).
fn yaml_message(e: &serde_yaml_ng::Error) -> (Option<(usize, usize)>, String) {
    let loc = e.location().map(|l| (l.line(), l.column()));
    (loc, strip_location(&e.to_string()))
}

/// Removes the ` at line N column M` that parsers put into their messages (the location is
/// reported in its own fields).
fn strip_location(msg: &str) -> String {
    let digits = |s: &str| s.trim_start_matches(|c: char| c.is_ascii_digit()).len();
    let mut out = String::with_capacity(msg.len());
    let mut rest = msg;
    while let Some(i) = rest.find(" at line ") {
        out.push_str(&rest[..i]);
        let after_line = &rest[i + " at line ".len()..];
        let after_line = &after_line[after_line.len() - digits(after_line)..];
        rest = match after_line.strip_prefix(" column ") {
            Some(col) => &col[col.len() - digits(col)..],
            None => after_line,
        };
    }
    out.push_str(rest);
    out
}

/// The base64 values under `field` (a Secret's `data`, a ConfigMap's `binaryData`) without the
/// line breaks (`\r`, `\n`) that the API server's decoder skips, as Go's does: a value written
/// in a YAML `|` block, as the Kubernetes documentation's `ssh-auth` and `dockercfg` examples
/// write theirs, reads as it would through `kubectl apply`.
fn base64_without_line_breaks(mut value: serde_json::Value, field: &str) -> serde_json::Value {
    if let Some(map) = value.get_mut(field).and_then(|d| d.as_object_mut()) {
        for v in map.values_mut() {
            if let Some(s) = v.as_str().filter(|s| s.contains(['\r', '\n'])) {
                *v = serde_json::Value::String(s.replace(['\r', '\n'], ""));
            }
        }
    }
    value
}

/// Rewrites a deserializer's message for the user. A base64 error names the offending
/// character and its offset (`'_' at offset 7`) instead of a byte value. For a Secret
/// (`secret`), no value is ever quoted: a Secret's values must not reach a log, an event or the
/// status API, so `invalid type: integer `98765432`` becomes `invalid type: integer` and a base64
/// error gives only the offset.
pub fn humanize(msg: &str, secret: bool) -> String {
    let msg = base64_message(msg, secret);
    if secret {
        redact_values(&msg)
    } else {
        msg
    }
}

/// The base64 decoder's errors in words (`Invalid symbol 95, offset 7.`).
fn base64_message(msg: &str, secret: bool) -> String {
    let number_after = |s: &str, prefix: &str| -> Option<(u64, usize)> {
        let i = s.find(prefix)? + prefix.len();
        let digits = s[i..].bytes().take_while(u8::is_ascii_digit).count();
        Some((s[i..i + digits].parse().ok()?, i + digits))
    };
    for (prefix, what) in [
        ("Invalid symbol ", "is not a base64 character"),
        (
            "Invalid last symbol ",
            "cannot end base64 data (it leaves bits over)",
        ),
    ] {
        let Some(start) = msg.find(prefix) else {
            continue;
        };
        let Some((byte, after)) = number_after(msg, prefix) else {
            continue;
        };
        let Some((offset, end)) = number_after(&msg[after..], ", offset ") else {
            continue;
        };
        let end = after + end + usize::from(msg[after + end..].starts_with('.'));
        let character = if secret {
            "the character".to_string()
        } else {
            match u8::try_from(byte).map(char::from) {
                Ok(c) if c.is_ascii_graphic() => format!("{c:?}"),
                _ => format!("byte 0x{byte:02x}"),
            }
        };
        return format!(
            "{}{character} at offset {offset} {what}{}",
            &msg[..start],
            &msg[end..]
        );
    }
    if let Some((n, _)) = number_after(msg, "Invalid input length: ") {
        return msg.replace(
            &format!("Invalid input length: {n}"),
            &format!("{n} base64 characters cannot be decoded (base64 comes in groups of 4, padded with '=')"),
        );
    }
    msg.replace("Invalid padding", "the base64 padding ('=') is wrong")
}

/// Drops the values serde quotes in its messages (`invalid type: string "x"`, `invalid value:
/// integer `5``), keeping what kind of value it was.
fn redact_values(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len());
    let mut rest = msg;
    while let Some(i) = ["invalid type: ", "invalid value: "]
        .iter()
        .filter_map(|p| rest.find(p).map(|i| i + p.len()))
        .min()
    {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        // The kind of value (`integer`, `floating point`, `string`, ...), then maybe its quote.
        let quote = rest.find(['`', '"']).filter(|q| {
            let kind = &rest[..*q];
            kind.ends_with(' ')
                && kind
                    .trim_end()
                    .chars()
                    .all(|c| c.is_ascii_alphabetic() || c == ' ')
        });
        let Some(q) = quote else { continue };
        out.push_str(rest[..q].trim_end());
        let close = rest.as_bytes()[q];
        let mut j = q + 1;
        let bytes = rest.as_bytes();
        while j < bytes.len() && bytes[j] != close {
            j += if bytes[j] == b'\\' { 2 } else { 1 };
        }
        rest = &rest[(j + 1).min(rest.len())..];
    }
    out.push_str(rest);
    out
}

/// Finds a field of the document in its text: `(line, column)`.
type Relocate<'a> = &'a dyn Fn(&[Step]) -> Option<(usize, usize)>;

/// Turns one document into objects (a `List` gives several). When a typed conversion fails,
/// `relocate` finds the field it failed at in the text.
fn convert(
    value: serde_json::Value,
    path: &Path,
    document: usize,
    relocate: Relocate<'_>,
    found: &mut Parsed,
) {
    if value.is_null() {
        return;
    }
    let kind = value
        .get("kind")
        .and_then(|k| k.as_str())
        .unwrap_or("")
        .to_string();
    let api_version = value
        .get("apiVersion")
        .and_then(|k| k.as_str())
        .unwrap_or("")
        .to_string();
    if kind.is_empty() {
        found.errors.push(manifest_error(
            path,
            Some(document),
            None,
            "the document has no kind; add `kind:` and `apiVersion:`".into(),
        ));
        return;
    }
    fn typed<T: DeserializeOwned>(
        value: serde_json::Value,
        kind: &str,
        path: &Path,
        document: usize,
        relocate: Relocate<'_>,
        errs: &mut Vec<ManifestError>,
    ) -> Option<T> {
        let name = object_name(kind, &value);
        match serde_path_to_error::deserialize::<_, T>(value) {
            Ok(t) => Some(t),
            Err(e) => {
                let loc = steps(e.path()).and_then(|s| relocate(&s));
                let field = e.path().to_string();
                let msg = strip_location(&e.inner().to_string());
                let msg = if field == "." {
                    msg
                } else {
                    format!("{field}: {msg}")
                };
                let mut msg = humanize(&msg, kind == "Secret");
                if kind == "Secret" && msg.starts_with("data.") {
                    msg.push_str(
                        " (values under data are base64; put plain text under stringData)",
                    );
                } else if kind == "Secret" && msg.starts_with("stringData.") {
                    msg.push_str(" (values under stringData are text: quote the value)");
                }
                errs.push(ManifestError {
                    object: name,
                    ..manifest_error(path, Some(document), loc, format!("invalid {kind}: {msg}"))
                });
                None
            }
        }
    }
    /// An object other than a pod, typed, with the fields its type lacks as its file's
    /// warnings (a pod's own are its warnings).
    fn object<T: DeserializeOwned>(
        value: serde_json::Value,
        kind: &str,
        path: &Path,
        document: usize,
        relocate: Relocate<'_>,
        found: &mut Parsed,
    ) -> Option<T> {
        for u in unknown_fields::<T>(&value) {
            let field = u.field(None);
            found.warnings.push(ManifestError {
                object: object_name(kind, &value),
                ..manifest_error(
                    path,
                    Some(document),
                    relocate(&u.path),
                    format!("{kind}: {field}: ignored"),
                )
            });
        }
        typed::<T>(value, kind, path, document, relocate, &mut found.errors)
    }
    let want_version = match kind.as_str() {
        "Pod" | "ConfigMap" | "Secret" | "PersistentVolume" | "PersistentVolumeClaim" | "List" => {
            "v1"
        }
        "CSIDriver" | "StorageClass" => "storage.k8s.io/v1",
        "VolumeSnapshot" | "VolumeSnapshotContent" => kubevol_core::snapshot::API_VERSION,
        other => {
            debug!(file = %path.display(), document, kind = other, "skipping object of a kind kubevol does not use");
            found.skipped.extend(object_name(other, &value));
            return;
        }
    };
    if api_version != want_version {
        found.errors.push(ManifestError {
            object: object_name(&kind, &value),
            ..manifest_error(
                path,
                Some(document),
                None,
                format!(
                    "apiVersion {api_version:?} is not supported for kind {kind}; use {want_version:?}"
                ),
            )
        });
        return;
    }
    let obj = match kind.as_str() {
        "List" => {
            if let Some(items) = value.get("items").and_then(|i| i.as_array()) {
                for (i, item) in items.clone().into_iter().enumerate() {
                    let in_item = |steps: &[Step]| {
                        let mut all = vec![Step::Key("items".into()), Step::Index(i)];
                        all.extend_from_slice(steps);
                        relocate(&all)
                    };
                    convert(item, path, document, &in_item, found);
                }
            }
            return;
        }
        "Pod" => {
            let raw = value.clone();
            let name = object_name(&kind, &value);
            let locate = |steps: &[Step]| {
                relocate(steps).map(|(line, column)| format!("line {line}, column {column}"))
            };
            typed::<Pod>(value, &kind, path, document, relocate, &mut found.errors).and_then(|p| {
                let unknown = crate::source::unknown::unknown_fields::<Pod>(&raw);
                match pod_extensions(&raw, &p, unknown, &locate) {
                    Ok(extensions) => Some(Object::Pod(normalize_pod(p), extensions)),
                    Err(fields) => {
                        for (i, message) in fields {
                            let steps = ["spec", "volumes"]
                                .map(|k| Step::Key(k.into()))
                                .into_iter()
                                .chain([Step::Index(i)])
                                .chain(["emptyDir", "mode"].map(|k| Step::Key(k.into())))
                                .collect::<Vec<_>>();
                            found.errors.push(ManifestError {
                                object: name.clone(),
                                ..manifest_error(
                                    path,
                                    Some(document),
                                    relocate(&steps),
                                    format!("invalid Pod: {message}"),
                                )
                            });
                        }
                        None
                    }
                }
            })
        }
        "ConfigMap" => {
            let value = base64_without_line_breaks(value, "binaryData");
            object::<ConfigMap>(value, &kind, path, document, relocate, found)
                .map(Object::ConfigMap)
        }
        "Secret" => {
            let value = base64_without_line_breaks(value, "data");
            object::<Secret>(value, &kind, path, document, relocate, found)
                .map(|s| Object::Secret(normalize_secret(s)))
        }
        "PersistentVolume" => {
            object::<PersistentVolume>(value, &kind, path, document, relocate, found)
                .map(Object::PersistentVolume)
        }
        "PersistentVolumeClaim" => {
            object::<PersistentVolumeClaim>(value, &kind, path, document, relocate, found)
                .map(Object::PersistentVolumeClaim)
        }
        "StorageClass" => object::<StorageClass>(value, &kind, path, document, relocate, found)
            .map(Object::StorageClass),
        "VolumeSnapshot" => object::<VolumeSnapshot>(value, &kind, path, document, relocate, found)
            .map(Object::VolumeSnapshot),
        "VolumeSnapshotContent" => {
            object::<VolumeSnapshotContent>(value, &kind, path, document, relocate, found)
                .map(Object::VolumeSnapshotContent)
        }
        _ => object::<CSIDriver>(value, &kind, path, document, relocate, found)
            .map(Object::CSIDriver),
    };
    found.objects.extend(obj.map(|o| (document, o)));
}

/// One YAML document as JSON, read as the Go YAML library that kubectl and the API server
/// use reads it: merge keys (`<<: *anchor`) applied, and a duplicate key refused. (Going
/// through the YAML library's own value is what refuses duplicates: deserialized straight into
/// JSON, the last of two equal keys would silently win.)
fn document_to_json(
    doc: serde_yaml_ng::Deserializer<'_>,
) -> Result<serde_json::Value, serde_yaml_ng::Error> {
    let mut value = serde_yaml_ng::Value::deserialize(doc)?;
    value.apply_merge()?;
    serde_json::to_value(value).map_err(serde::de::Error::custom)
}

/// Accepts the escapes of double-quoted scalars that the Go YAML library accepts and this
/// parser refuses: `\'` (a single quote). Only double-quoted scalars are rewritten; plain,
/// single-quoted and block scalars (`|`, `>`) and comments are left exactly as they are.
fn go_yaml_escapes(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains("\\'") {
        return std::borrow::Cow::Borrowed(text);
    }
    #[derive(PartialEq)]
    enum State {
        Plain,
        Double,
        Single,
    }
    let mut out = String::with_capacity(text.len());
    let mut state = State::Plain;
    // The indentation of the line that opened a block scalar, while inside it.
    let mut block: Option<usize> = None;
    for line in text.split_inclusive('\n') {
        let indent = line.len() - line.trim_start_matches(' ').len();
        let blank = line.trim().is_empty();
        if let Some(b) = block {
            if blank || indent > b {
                out.push_str(line);
                continue;
            }
            block = None;
        }
        // The last significant character before the current one on this line.
        let mut before: Option<char> = None;
        let mut chars = line.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            match state {
                State::Double => match c {
                    '\\' => match chars.peek() {
                        Some((_, '\'')) => {
                            chars.next();
                            out.push('\'');
                            continue;
                        }
                        Some(&(_, next)) => {
                            chars.next();
                            out.push(c);
                            out.push(next);
                            continue;
                        }
                        None => {}
                    },
                    '"' => state = State::Plain,
                    _ => {}
                },
                State::Single => {
                    if c == '\'' {
                        if chars.peek().is_some_and(|(_, n)| *n == '\'') {
                            chars.next();
                            out.push_str("''");
                            continue;
                        }
                        state = State::Plain;
                    }
                }
                State::Plain => {
                    let starts_scalar =
                        before.is_none_or(|b| matches!(b, ':' | '-' | '[' | '{' | ',' | '?'));
                    match c {
                        '#' if i == 0 || line[..i].ends_with([' ', '\t']) => {
                            out.push_str(&line[i..]);
                            break;
                        }
                        '"' if starts_scalar => state = State::Double,
                        '\'' if starts_scalar => state = State::Single,
                        '|' | '>' if before.is_some_and(|b| b == ':' || b == '-') => {
                            block = Some(indent);
                        }
                        _ => {}
                    }
                }
            }
            out.push(c);
            if !c.is_whitespace() {
                before = Some(c);
            }
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Reads file modes written the way Kubernetes manifests write them. Kubernetes reads YAML 1.1,
/// where a plain `0644` is octal (420); the YAML 1.2 parser here keeps it as the string "0644".
/// The API's mode fields (`defaultMode`, `mode`) are integers, so such a string in them can only
/// mean the octal number.
/// Returns whether it read any.
fn yaml11_octal_modes(value: &mut serde_json::Value) -> bool {
    let mut any = false;
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map.iter_mut() {
                if k == "defaultMode" || k == "mode" {
                    if let Some(s) = v.as_str() {
                        let octal = s.len() > 1
                            && s.starts_with('0')
                            && s.bytes().all(|c| (b'0'..=b'7').contains(&c));
                        if let Some(n) = octal.then(|| i64::from_str_radix(s, 8).ok()).flatten() {
                            *v = serde_json::Value::from(n);
                            any = true;
                        }
                    }
                }
                any |= yaml11_octal_modes(v);
            }
        }
        serde_json::Value::Array(items) => {
            for item in items {
                any |= yaml11_octal_modes(item);
            }
        }
        _ => {}
    }
    any
}

/// Parses a manifest file's text. Returns the objects (with their 1-based document index) and
/// every problem found.
pub fn parse_manifest(path: &Path, text: &str) -> (Vec<(usize, Object)>, Vec<ManifestError>) {
    let parsed = parse_file(path, text);
    (parsed.objects, parsed.errors)
}

/// What a manifest file's text holds.
#[derive(Default)]
pub struct Parsed {
    /// The objects kubevol keeps, with their 1-based document index.
    pub objects: Vec<(usize, Object)>,
    /// Every problem found.
    pub errors: Vec<ManifestError>,
    /// The objects of kinds kubevol does not run (Deployment, Job, ...).
    pub skipped: Vec<ObjectName>,
    /// Fields of its objects (other than pods, whose own are theirs) that kubevol's API types
    /// do not have: ignored.
    pub warnings: Vec<ManifestError>,
}

/// How many times one file may be parsed again to locate its fields, when the event parser
/// behind [`super::shape::check`] could not read it (and so gave no layout): each walk parses
/// the file again, and a file with thousands of errors must not cost thousands of parses.
const FALLBACK_WALKS: usize = 16;

/// Finds the line and column of a field of a file's text: in the layout that the shape check's
/// one pass made, or, where it made none, by walking the document again with the deserializer
/// (at most [`FALLBACK_WALKS`] times a file; later fields go unlocated).
struct Finder<'t> {
    text: &'t str,
    json: bool,
    layout: Layout,
    walks: std::cell::Cell<usize>,
}

impl Finder<'_> {
    /// Whether the file may be walked once more.
    fn may_walk(&self) -> bool {
        #[cfg(test)]
        tests::WALKS.with(|w| w.set(w.get() + 1));
        let n = self.walks.get();
        self.walks.set(n + 1);
        n < FALLBACK_WALKS
    }

    /// The line and column of the node `steps` lead to in document `i` (0-based), whose value
    /// was read as `value`.
    fn find(&self, i: usize, value_is_map: bool, steps: &[Step]) -> Option<(usize, usize)> {
        if self.layout.is_map(i) == value_is_map && self.layout.has(i) {
            return self.layout.find(i, steps);
        }
        if !self.may_walk() {
            return None;
        }
        if self.json {
            let e = locate(&mut serde_json::Deserializer::from_str(self.text), steps).err()?;
            return Some((e.line(), e.column()));
        }
        let doc = serde_yaml_ng::Deserializer::from_str(self.text).nth(i)?;
        let e = locate(doc, steps).err()?;
        e.location().map(|l| (l.line(), l.column()))
    }

    /// The quoted mode fields of document `i`: path, value, line and column.
    fn quoted_modes(&self, i: usize) -> Vec<(String, String, (usize, usize))> {
        if self.layout.has(i) {
            return self.layout.quoted_modes(i);
        }
        if !self.may_walk() {
            return Vec::new();
        }
        let doc = serde_yaml_ng::Deserializer::from_str(self.text).nth(i);
        doc.map(|d| quoted_modes(self.text, d).unwrap_or_default())
            .unwrap_or_default()
            .into_iter()
            .map(|q| {
                let at = line_column(self.text, q.offset);
                (q.path, q.value, at)
            })
            .collect()
    }
}

/// Parses a manifest file's text, keeping the names of the objects it skips too. The text is
/// parsed once by the event parser of the shape check (which also says where every node is)
/// and once by the deserializer, whatever the file holds: its errors, warnings and quoted
/// modes are located in the first pass's layout.
pub fn parse_file(path: &Path, text: &str) -> Parsed {
    let mut found = Parsed::default();
    let json = path.extension().and_then(|e| e.to_str()) == Some("json");
    let text = match json {
        true => std::borrow::Cow::Borrowed(text),
        false => go_yaml_escapes(text),
    };
    let text = &*text;
    let layout = match super::shape::check(text) {
        Ok(layout) => layout,
        Err(e) => {
            let at = Some((e.line, e.column));
            found.errors.push(manifest_error(path, None, at, e.message));
            return found;
        }
    };
    let finder = Finder {
        text,
        json,
        layout,
        walks: std::cell::Cell::new(0),
    };
    if json {
        match serde_json::from_str::<serde_json::Value>(text) {
            Ok(v) => {
                let is_map = v.is_object();
                let relocate = |steps: &[Step]| finder.find(0, is_map, steps);
                convert(v, path, 1, &relocate, &mut found);
            }
            Err(e) => {
                found.errors.push(manifest_error(
                    path,
                    Some(1),
                    Some((e.line(), e.column())),
                    strip_location(&e.to_string()),
                ));
            }
        }
        return found;
    }
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let document = i + 1;
        let mut value = match document_to_json(doc) {
            Ok(v) => v,
            Err(e) => {
                let (loc, msg) = yaml_message(&e);
                found
                    .errors
                    .push(manifest_error(path, Some(document), loc, msg));
                // After a syntax error the rest of the stream cannot be trusted.
                break;
            }
        };
        if yaml11_octal_modes(&mut value) {
            // Only a plain 0644 is octal: a quoted one is a string, which the API refuses.
            let quoted = finder.quoted_modes(i);
            if !quoted.is_empty() {
                let kind = value.get("kind").and_then(|k| k.as_str()).unwrap_or("");
                for (field, mode, at) in quoted {
                    found.errors.push(ManifestError {
                        object: object_name(kind, &value),
                        ..manifest_error(
                            path,
                            Some(document),
                            Some(at),
                            format!(
                                "invalid {kind}: {field}: Invalid value: {mode:?}: a mode is an integer, not a string: remove the quotes ({mode} is then read as an octal number, as Kubernetes reads YAML) or write the decimal {}",
                                i64::from_str_radix(&mode, 8).unwrap_or_default()
                            ),
                        )
                    });
                }
                continue;
            }
        }
        let is_map = value.is_object();
        let relocate = |steps: &[Step]| finder.find(i, is_map, steps);
        convert(value, path, document, &relocate, &mut found);
    }
    found
}

#[cfg(test)]
mod tests;
