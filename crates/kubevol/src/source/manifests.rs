//! The manifest-directory source: every `*.yaml`, `*.yml` and `*.json` file of a directory,
//! multi-document, parsed into Kubernetes objects, and watched with inotify so that adding,
//! changing or removing a file updates the store within one event.
//!
//! A file with an error (it does not parse, or a document is not a valid object) is reported with
//! its path, document, line and column and is not applied: the objects it delivered before stay
//! in place, so a half-saved edit never unmounts a running pod. Other files are unaffected.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, PersistentVolumeClaim, Pod, Secret};
use k8s_openapi::api::storage::v1::CSIDriver;
use notify::Watcher;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::store::{
    normalize_pod, normalize_secret, Change, FileContent, ManifestError, Object, ObjectName,
    ObjectStore, DEFAULT_NAMESPACE,
};

/// Whether a file name is a manifest kubevol reads.
pub fn is_manifest_file(path: &Path) -> bool {
    let hidden = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_none_or(|n| n.starts_with('.'));
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    !hidden && matches!(ext, "yaml" | "yml" | "json")
}

fn manifest_error(
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
    let cluster_scoped = matches!(kind, "PersistentVolume" | "CSIDriver");
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

/// The typed deserialization error of a document of `kind`, with the deserializer's location,
/// or `None` when the kind is not one kubevol keeps or the document deserializes fine.
fn deserialize_error<'de, D: serde::Deserializer<'de>>(kind: &str, d: D) -> Option<D::Error> {
    match kind {
        "Pod" => Pod::deserialize(d).err(),
        "ConfigMap" => ConfigMap::deserialize(d).err(),
        "Secret" => Secret::deserialize(d).err(),
        "PersistentVolume" => PersistentVolume::deserialize(d).err(),
        "PersistentVolumeClaim" => PersistentVolumeClaim::deserialize(d).err(),
        "CSIDriver" => CSIDriver::deserialize(d).err(),
        _ => None,
    }
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

/// Re-parses a document as a kind, for the location of its error: `(line, column)`, message.
type Relocate<'a> = &'a dyn Fn(&str) -> Option<(Option<(usize, usize)>, String)>;

/// Turns one document into objects (a `List` gives several). When a typed conversion fails,
/// `relocate` re-parses the document with location information.
fn convert(
    value: serde_json::Value,
    path: &Path,
    document: usize,
    relocate: Relocate<'_>,
    out: &mut Vec<(usize, Object)>,
    errs: &mut Vec<ManifestError>,
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
        errs.push(manifest_error(
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
                let (loc, msg) = relocate(kind).unwrap_or_else(|| {
                    let path = e.path().to_string();
                    let msg = strip_location(&e.inner().to_string());
                    (
                        None,
                        if path == "." {
                            msg
                        } else {
                            format!("{path}: {msg}")
                        },
                    )
                });
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
    let want_version = match kind.as_str() {
        "Pod" | "ConfigMap" | "Secret" | "PersistentVolume" | "PersistentVolumeClaim" | "List" => {
            "v1"
        }
        "CSIDriver" => "storage.k8s.io/v1",
        other => {
            debug!(file = %path.display(), document, kind = other, "skipping object of a kind kubevol does not use");
            return;
        }
    };
    if api_version != want_version {
        errs.push(ManifestError {
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
    let obj =
        match kind.as_str() {
            "List" => {
                if let Some(items) = value.get("items").and_then(|i| i.as_array()) {
                    // Re-parsing the whole List as one item's kind would point at the wrong place.
                    let no_location = |_: &str| None;
                    for item in items.clone() {
                        convert(item, path, document, &no_location, out, errs);
                    }
                }
                return;
            }
            "Pod" => typed::<Pod>(value, &kind, path, document, relocate, errs)
                .map(|p| Object::Pod(normalize_pod(p))),
            "ConfigMap" => typed::<ConfigMap>(value, &kind, path, document, relocate, errs)
                .map(Object::ConfigMap),
            "Secret" => typed::<Secret>(value, &kind, path, document, relocate, errs)
                .map(|s| Object::Secret(normalize_secret(s))),
            "PersistentVolume" => {
                typed::<PersistentVolume>(value, &kind, path, document, relocate, errs)
                    .map(Object::PersistentVolume)
            }
            "PersistentVolumeClaim" => {
                typed::<PersistentVolumeClaim>(value, &kind, path, document, relocate, errs)
                    .map(Object::PersistentVolumeClaim)
            }
            _ => typed::<CSIDriver>(value, &kind, path, document, relocate, errs)
                .map(Object::CSIDriver),
        };
    out.extend(obj.map(|o| (document, o)));
}

/// Reads file modes written the way Kubernetes manifests write them. Kubernetes reads YAML 1.1,
/// where a plain `0644` is octal (420); the YAML 1.2 parser here keeps it as the string "0644".
/// The API's mode fields (`defaultMode`, `mode`) are integers, so such a string in them can only
/// mean the octal number.
fn yaml11_octal_modes(value: &mut serde_json::Value) {
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
                        }
                    }
                }
                yaml11_octal_modes(v);
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(yaml11_octal_modes),
        _ => {}
    }
}

/// Parses a manifest file's text. Returns the objects (with their 1-based document index) and
/// every problem found.
pub fn parse_manifest(path: &Path, text: &str) -> (Vec<(usize, Object)>, Vec<ManifestError>) {
    let mut out = Vec::new();
    let mut errs = Vec::new();
    if path.extension().and_then(|e| e.to_str()) == Some("json") {
        match serde_json::from_str::<serde_json::Value>(text) {
            Ok(v) => {
                let relocate = |kind: &str| {
                    let e = deserialize_error(kind, &mut serde_json::Deserializer::from_str(text))?;
                    Some((Some((e.line(), e.column())), strip_location(&e.to_string())))
                };
                convert(v, path, 1, &relocate, &mut out, &mut errs);
            }
            Err(e) => {
                errs.push(manifest_error(
                    path,
                    Some(1),
                    Some((e.line(), e.column())),
                    strip_location(&e.to_string()),
                ));
            }
        }
        return (out, errs);
    }
    for (i, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let document = i + 1;
        let mut value = match serde_json::Value::deserialize(doc) {
            Ok(v) => v,
            Err(e) => {
                let (loc, msg) = yaml_message(&e);
                errs.push(manifest_error(path, Some(document), loc, msg));
                // After a syntax error the rest of the stream cannot be trusted.
                break;
            }
        };
        yaml11_octal_modes(&mut value);
        let relocate = |kind: &str| {
            let doc = serde_yaml_ng::Deserializer::from_str(text).nth(i)?;
            deserialize_error(kind, doc).map(|e| yaml_message(&e))
        };
        convert(value, path, document, &relocate, &mut out, &mut errs);
    }
    (out, errs)
}

/// Whether an inotify event leaves a file in a state worth reading: the writer closed it, or it
/// appeared, moved or went away. A plain modification is not: `write(2)` after `O_TRUNC` shows
/// an empty or half-written file, and reading it then would take its pods away.
pub fn settles_file(kind: &notify::EventKind) -> bool {
    use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind};
    matches!(
        kind,
        EventKind::Access(AccessKind::Close(AccessMode::Write))
            | EventKind::Create(_)
            | EventKind::Remove(_)
            | EventKind::Modify(ModifyKind::Name(_))
    )
}

/// The largest manifest file read by default (8 MiB; the API server's own request limit is
/// 3 MiB, so no real manifest comes near it).
pub const DEFAULT_MAX_FILE_SIZE: u64 = 8 << 20;

/// How long reading one file may take before the file is reported and the others are read
/// without it (a file on a hung filesystem).
const READ_STALL: Duration = Duration::from_secs(10);

/// What a file that is not a regular file is, in words.
fn file_type_name(mode: rustix::fs::FileType) -> &'static str {
    use rustix::fs::FileType;
    match mode {
        FileType::Directory => "a directory",
        FileType::Fifo => "a FIFO (named pipe)",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Socket => "a socket",
        FileType::Symlink => "a symbolic link",
        FileType::RegularFile => "a regular file",
        FileType::Unknown => "of an unknown type",
    }
}

/// Reads one manifest file as the store takes it: its objects, its errors, or that it is gone.
///
/// Only a regular file is read (a symbolic link is followed, and the type is checked on the
/// opened descriptor, so nothing can be swapped in between), opened non-blocking so that a
/// FIFO or a device never blocks, and at most `max_size` bytes of it.
pub fn read_file(path: &Path, max_size: u64) -> FileContent {
    use rustix::fs::{FileType, Mode, OFlags};
    let broken = |message: String| {
        let err = manifest_error(path, None, None, message);
        warn!("{err}");
        FileContent::Broken(vec![err])
    };
    let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY;
    let fd = match rustix::fs::open(path, flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => {
            info!(file = %path.display(), "manifest removed");
            return FileContent::Gone;
        }
        Err(e) => return broken(format!("cannot open: {}", std::io::Error::from(e))),
    };
    let stat = match rustix::fs::fstat(&fd) {
        Ok(st) => st,
        Err(e) => return broken(format!("cannot stat: {}", std::io::Error::from(e))),
    };
    let kind = FileType::from_raw_mode(stat.st_mode);
    if kind != FileType::RegularFile {
        return broken(format!(
            "is {} (after following links), not a regular file: only regular files are read as manifests; remove it or give it another extension",
            file_type_name(kind)
        ));
    }
    let too_big = |size: u64| {
        format!(
            "is {size} bytes, more than the limit of {max_size} bytes for one manifest file: split it, or raise the limit (--max-manifest-size)"
        )
    };
    let size = stat.st_size as u64;
    if size > max_size {
        return broken(too_big(size));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    // A file that grows while it is read is still cut at the limit.
    if let Err(e) = std::io::Read::read_to_end(
        &mut std::io::Read::take(std::fs::File::from(fd), max_size + 1),
        &mut bytes,
    ) {
        return broken(format!("cannot read: {e}"));
    }
    if bytes.len() as u64 > max_size {
        return broken(too_big(bytes.len() as u64));
    }
    let text = match String::from_utf8(bytes) {
        Ok(t) => t,
        Err(e) => {
            return broken(format!(
                "is not UTF-8 text (byte {} is not valid): manifests are YAML or JSON text",
                e.utf8_error().valid_up_to()
            ))
        }
    };
    let (objects, errors) = parse_manifest(path, &text);
    for e in &errors {
        warn!("{e}");
    }
    if errors.is_empty() {
        debug!(file = %path.display(), objects = objects.len(), "manifest loaded");
        FileContent::Objects(objects)
    } else {
        // A file with any error is not applied: what it delivered before stays, so a
        // half-written edit never takes a running pod's volumes away.
        FileContent::Broken(errors)
    }
}

/// How long the watch waits for the second half of a rename (the new name) before it takes
/// the first half for a file moved out of the directory. Both halves come from one rename(2)
/// and are reported within microseconds; the wait only bounds the case where no second half
/// ever comes.
const RENAME_PAIR_WAIT: Duration = Duration::from_secs(1);

/// Whether a batch of events holds the old name of a rename without its new name.
fn unpaired_rename(batch: &[notify::Result<notify::Event>]) -> bool {
    use notify::event::{EventKind, ModifyKind, RenameMode};
    let tracked = |mode: RenameMode| {
        batch
            .iter()
            .flatten()
            .filter(move |e| e.kind == EventKind::Modify(ModifyKind::Name(mode)))
            .filter_map(|e| e.tracker())
    };
    let mut paired = tracked(RenameMode::To).chain(tracked(RenameMode::Both));
    let paired: BTreeSet<usize> = paired.by_ref().collect();
    tracked(RenameMode::From).any(|t| !paired.contains(&t))
}

/// The manifest-directory source.
#[derive(Clone)]
pub struct ManifestSource {
    dir: PathBuf,
    store: Arc<ObjectStore>,
    max_file_size: u64,
}

impl ManifestSource {
    /// The source's name in the store's sync gate.
    pub const NAME: &'static str = "file";

    /// A source for `dir`, registered with the store (teardown waits for its first listing).
    pub fn new(dir: &Path, store: Arc<ObjectStore>) -> std::io::Result<Self> {
        let dir = std::fs::canonicalize(dir)?;
        if !dir.is_dir() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotADirectory,
                format!("{} is not a directory", dir.display()),
            ));
        }
        store.register_source(Self::NAME);
        Ok(ManifestSource {
            dir,
            store,
            max_file_size: DEFAULT_MAX_FILE_SIZE,
        })
    }

    /// Sets the largest file read (bigger files are reported, not read).
    pub fn with_max_file_size(mut self, bytes: u64) -> Self {
        self.max_file_size = bytes;
        self
    }

    /// The directory read.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads files into changes for the store, never waiting on one file for long: a file
    /// whose read has not finished after a while (a hung filesystem) is reported as such and
    /// the rest are read on another thread.
    async fn read_files(&self, paths: Vec<PathBuf>) -> Vec<Change> {
        let mut changes = Vec::with_capacity(paths.len());
        let mut rest = std::collections::VecDeque::from(paths);
        while !rest.is_empty() {
            let (tx, mut rx) = mpsc::unbounded_channel();
            let todo: Vec<PathBuf> = rest.iter().cloned().collect();
            let max = self.max_file_size;
            tokio::task::spawn_blocking(move || {
                for path in todo {
                    let content = read_file(&path, max);
                    if tx.send(Change::File { path, content }).is_err() {
                        return;
                    }
                }
            });
            loop {
                match tokio::time::timeout(READ_STALL, rx.recv()).await {
                    Ok(Some(change)) => {
                        rest.pop_front();
                        changes.push(change);
                    }
                    Ok(None) => break,
                    Err(_) => {
                        let Some(path) = rest.pop_front() else { break };
                        let err = manifest_error(
                            &path,
                            None,
                            None,
                            format!("reading it has not finished after {READ_STALL:?} (is its filesystem hung?); other files carry on, and it is read again on its next change"),
                        );
                        warn!("{err}");
                        changes.push(Change::File {
                            path,
                            content: FileContent::Broken(vec![err]),
                        });
                        break;
                    }
                }
            }
        }
        changes
    }

    /// Reads one file (or forgets it, if it is gone) into the store.
    pub async fn load_file(&self, path: &Path) {
        if is_manifest_file(path) {
            let changes = self.read_files(vec![path.to_path_buf()]).await;
            self.store.apply(changes);
        }
    }

    /// Reads every manifest file, and forgets files that are gone, as one change of the store.
    pub async fn load_all(&self) -> std::io::Result<()> {
        let dir = self.dir.clone();
        let listed = tokio::task::spawn_blocking(move || -> std::io::Result<BTreeSet<PathBuf>> {
            let mut present = BTreeSet::new();
            for entry in std::fs::read_dir(&dir)? {
                let path = entry?.path();
                if is_manifest_file(&path) {
                    present.insert(path);
                }
            }
            Ok(present)
        })
        .await
        .map_err(std::io::Error::other)??;
        let mut changes = self.read_files(listed.iter().cloned().collect()).await;
        for known in self.store.known_files() {
            if known.starts_with(&self.dir) && !listed.contains(&known) {
                changes.push(Change::File {
                    path: known,
                    content: FileContent::Gone,
                });
            }
        }
        self.store.apply(changes);
        Ok(())
    }

    /// Starts watching the directory, reads it once completely, marks the source synced, and
    /// then applies every change as inotify reports it, until the returned task is dropped or
    /// aborted. The events that arrive together are applied together: a rename (the old name
    /// gone, the new one there) never shows the store a moment without the pods it moved.
    pub async fn start(self) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let (tx, mut rx) = mpsc::unbounded_channel::<notify::Result<notify::Event>>();
        let mut watcher = notify::recommended_watcher(move |ev| {
            let _ = tx.send(ev);
        })
        .map_err(std::io::Error::other)?;
        // Watch before the first listing, so no change between the two is lost.
        watcher
            .watch(&self.dir, notify::RecursiveMode::NonRecursive)
            .map_err(std::io::Error::other)?;
        self.load_all().await?;
        self.store.mark_source_synced(Self::NAME);
        info!(dir = %self.dir.display(), "manifest directory listed");
        Ok(tokio::spawn(async move {
            let _watcher = watcher;
            while let Some(first) = rx.recv().await {
                let mut batch = vec![first];
                while let Ok(more) = rx.try_recv() {
                    batch.push(more);
                }
                // The two halves of a rename are reported one after the other: applying the
                // old name's removal without the new name would take the pod away.
                while unpaired_rename(&batch) {
                    match tokio::time::timeout(RENAME_PAIR_WAIT, rx.recv()).await {
                        Ok(Some(more)) => batch.push(more),
                        // Moved out of the directory (or the watch ended): a removal.
                        Ok(None) | Err(_) => break,
                    }
                }
                let mut paths = BTreeSet::new();
                let mut rescan = false;
                for ev in batch {
                    match ev {
                        Ok(ev) if ev.need_rescan() => rescan = true,
                        Ok(ev) if settles_file(&ev.kind) => {
                            paths.extend(ev.paths.into_iter().filter(|p| is_manifest_file(p)))
                        }
                        // Opens (kubevol's own reads among them) and writes in progress.
                        Ok(_) => {}
                        Err(e) => {
                            warn!(dir = %self.dir.display(), "watch error, re-reading the directory: {e}");
                            rescan = true;
                        }
                    }
                }
                if rescan {
                    if let Err(e) = self.load_all().await {
                        warn!(dir = %self.dir.display(), "cannot list manifest directory: {e}");
                    }
                } else if !paths.is_empty() {
                    let changes = self.read_files(paths.into_iter().collect()).await;
                    self.store.apply(changes);
                }
            }
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(name: &str, text: &str) -> (Vec<(usize, Object)>, Vec<String>) {
        let (o, e) = parse_manifest(Path::new(name), text);
        (o, e.iter().map(|e| e.to_string()).collect())
    }

    #[test]
    fn multi_document_yaml_with_known_and_unknown_kinds() {
        let (objs, errs) = parse(
            "/m/a.yaml",
            "apiVersion: v1\nkind: Pod\nmetadata: {name: web}\nspec: {containers: [{name: c}]}\n---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: cm}\ndata: {a: b}\n---\n",
        );
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(objs.len(), 2);
        assert_eq!(objs[0].0, 1);
        assert_eq!(objs[1].0, 3);
        let Object::Pod(p) = &objs[0].1 else {
            panic!("pod expected")
        };
        assert_eq!(p.metadata.namespace.as_deref(), Some("default"));
        assert!(p.metadata.uid.is_some());
    }

    #[test]
    fn flow_style_yaml_parses() {
        let (objs, errs) = parse(
            "/m/flow.yaml",
            r#"{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "flow"}, "spec": {"containers": [{"name": "c", "volumeMounts": [{"name": "v", "mountPath": "/v"}]}], "volumes": [{"name": "v", "emptyDir": {}}]}}"#,
        );
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(objs.len(), 1);
    }

    #[test]
    fn a_document_that_does_not_load_names_its_object() {
        let text = "apiVersion: v1\nkind: Secret\nmetadata: {name: s, namespace: prod}\ndata: {k: \"not base64!\"}\n---\napiVersion: v2\nkind: PersistentVolume\nmetadata: {name: pv, namespace: ignored}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {}\ndata: 3\n";
        let (objs, errs) = parse_manifest(Path::new("/m/o.yaml"), text);
        assert!(objs.is_empty());
        let names: Vec<_> = errs.iter().map(|e| e.object.clone()).collect();
        let name = |kind: &str, namespace: &str, name: &str| {
            Some(ObjectName {
                kind: kind.into(),
                namespace: namespace.into(),
                name: name.into(),
            })
        };
        assert_eq!(
            names,
            [
                name("Secret", "prod", "s"),
                name("PersistentVolume", "", "pv"),
                None
            ],
            "{errs:?}"
        );
        assert!(
            errs[0]
                .to_string()
                .starts_with("/m/o.yaml: document 1, line 4, column 11: invalid Secret: data.k:")
                && errs[0]
                    .message
                    .ends_with(" (values under data are base64; put plain text under stringData)"),
            "{}",
            errs[0]
        );
    }

    #[test]
    fn syntax_error_names_file_document_line_and_column() {
        let (_, errs) = parse("/m/bad.yaml", "apiVersion: v1\nkind: Pod\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: [unclosed\n");
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert!(errs[0].starts_with("/m/bad.yaml: document 2, line 7, column 1: did not find expected ',' or ']', while parsing a flow sequence"), "{}", errs[0]);
    }

    #[test]
    fn type_error_is_located() {
        let (objs, errs) = parse(
            "/m/t.yaml",
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\nspec:\n  containers: notalist\n",
        );
        assert!(objs.is_empty());
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert!(
            errs[0].starts_with("/m/t.yaml: document 1, line 6, column"),
            "{}",
            errs[0]
        );
        assert!(errs[0].contains("invalid Pod"), "{}", errs[0]);
    }

    #[test]
    fn json_files_and_their_errors() {
        let (objs, errs) = parse(
            "/m/p.json",
            r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"j"},"spec":{"containers":[]}}"#,
        );
        assert_eq!((objs.len(), errs.len()), (1, 0));
        let (_, errs) = parse("/m/p.json", "{\n  \"kind\": \"Pod\",\n  oops\n}");
        assert!(
            errs[0].starts_with("/m/p.json: document 1, line 3, column"),
            "{}",
            errs[0]
        );
    }

    #[test]
    fn every_kind_is_located_in_json_too() {
        let (_, errs) = parse(
            "/m/pv.json",
            "{\"apiVersion\": \"v1\", \"kind\": \"PersistentVolume\",\n \"metadata\": {\"name\": \"pv\"},\n \"spec\": {\"capacity\": 5}}",
        );
        assert!(
            errs[0].starts_with("/m/pv.json: document 1, line 3, column"),
            "{}",
            errs[0]
        );
    }

    #[test]
    fn locations_are_stripped_from_messages() {
        let rows = [
            ("bad at line 3 column 7", "bad"),
            (
                "bad at line 3 column 7, while parsing",
                "bad, while parsing",
            ),
            ("bad at line 12", "bad"),
            ("no location here", "no location here"),
        ];
        for (msg, want) in rows {
            assert_eq!(strip_location(msg), want, "row {msg:?}");
        }
    }

    #[test]
    fn wrong_api_version_and_missing_kind() {
        let (_, errs) = parse(
            "/m/v.yaml",
            "apiVersion: v2\nkind: Pod\n---\nmetadata: {name: x}\n",
        );
        assert!(
            errs[0].contains("document 1: apiVersion \"v2\" is not supported for kind Pod"),
            "{}",
            errs[0]
        );
        assert!(
            errs[1].contains("document 2: the document has no kind"),
            "{}",
            errs[1]
        );
    }

    #[test]
    fn only_settled_files_are_read() {
        use notify::event::{
            AccessKind, AccessMode, CreateKind, DataChange, EventKind, ModifyKind, RemoveKind,
            RenameMode,
        };
        assert!(settles_file(&EventKind::Access(AccessKind::Close(
            AccessMode::Write
        ))));
        assert!(settles_file(&EventKind::Create(CreateKind::File)));
        assert!(settles_file(&EventKind::Remove(RemoveKind::File)));
        assert!(settles_file(&EventKind::Modify(ModifyKind::Name(
            RenameMode::To
        ))));
        assert!(
            !settles_file(&EventKind::Modify(ModifyKind::Data(DataChange::Any))),
            "a write in progress"
        );
        assert!(!settles_file(&EventKind::Access(AccessKind::Open(
            AccessMode::Any
        ))));
    }

    #[test]
    fn octal_modes_as_kubernetes_reads_them() {
        let (objs, errs) = parse(
            "p.yaml",
            "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers: []\n  volumes:\n  - name: s\n    secret: {secretName: s, defaultMode: 0400, items: [{key: k, path: k, mode: 0644}]}\n  - name: c\n    configMap: {name: c, defaultMode: 420}\n",
        );
        assert!(errs.is_empty(), "{errs:?}");
        let Object::Pod(p) = &objs[0].1 else {
            panic!("a pod")
        };
        let vols = p.spec.as_ref().unwrap().volumes.as_ref().unwrap();
        let s = vols[0].secret.as_ref().unwrap();
        assert_eq!(s.default_mode, Some(0o400));
        assert_eq!(s.items.as_ref().unwrap()[0].mode, Some(0o644));
        assert_eq!(vols[1].config_map.as_ref().unwrap().default_mode, Some(420));
        let (_, errs) = parse("p.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [], volumes: [{name: s, secret: {defaultMode: 0800}}]}\n");
        assert_eq!(errs.len(), 1, "0800 is not octal: {errs:?}");
    }

    #[test]
    fn secret_values_never_appear_in_errors() {
        // (row, document, the value that must not appear, what the message must say)
        let rows = [
            ("stringData number", "stringData: {pin: 98765432}", "98765432", "stringData.pin: invalid type: integer, expected a string (values under stringData are text: quote the value)"),
            ("data number", "data: {password: 424242424242}", "424242424242", "data.password: invalid type: integer, expected a base64-encoded string"),
            ("data not base64", "data: {password: \"c2VjcmV0_dmFsdWU=\"}", "_", "data.password: the character at offset 8 is not a base64 character"),
            ("data float", "data: {password: 1.5e300}", "1.5e300", "data.password: the character at offset 1 is not a base64 character"),
            ("stringData map", "stringData: {pin: {nested: hunter2}}", "hunter2", "stringData.pin: invalid type: map, expected a string"),
            ("stringData bool", "stringData: {pin: true}", "true", "stringData.pin: invalid type: boolean, expected a string"),
        ];
        for (row, body, secret, want) in rows {
            let text = format!("apiVersion: v1\nkind: Secret\nmetadata: {{name: s}}\n{body}\n");
            let (_, errs) = parse("/m/s.yaml", &text);
            assert_eq!(errs.len(), 1, "row {row}: {errs:?}");
            let msg = errs[0].split("invalid Secret: ").nth(1).unwrap_or(&errs[0]);
            assert!(!msg.contains(secret), "row {row}: the value leaks: {msg}");
            assert!(msg.starts_with(want), "row {row}: {msg} / {}", errs[0]);
            // Inside a List too, where no location is known.
            let list = format!("apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Secret\n  metadata: {{name: s}}\n  {body}\n");
            let (_, errs) = parse("/m/l.yaml", &list);
            assert_eq!(errs.len(), 1, "row {row} in a List: {errs:?}");
            let msg = errs[0].split("invalid Secret: ").nth(1).unwrap_or(&errs[0]);
            assert!(
                !msg.contains(secret),
                "row {row} in a List: the value leaks: {msg}"
            );
        }
    }

    #[test]
    fn base64_errors_name_the_character_outside_secrets() {
        let rows = [
            ("Invalid symbol 95, offset 7.", "'_' at offset 7 is not a base64 character"),
            ("x: Invalid symbol 10, offset 2. (hint)", "x: byte 0x0a at offset 2 is not a base64 character (hint)"),
            ("Invalid last symbol 66, offset 3.", "'B' at offset 3 cannot end base64 data (it leaves bits over)"),
            ("Invalid input length: 5", "5 base64 characters cannot be decoded (base64 comes in groups of 4, padded with '=')"),
            ("Invalid padding", "the base64 padding ('=') is wrong"),
        ];
        for (msg, want) in rows {
            assert_eq!(humanize(msg, false), want, "row {msg:?}");
        }
        let (_, errs) = parse(
            "/m/c.yaml",
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\nbinaryData: {b: \"YWJj_ZGVm\"}\n",
        );
        assert!(
            errs[0].contains("binaryData.b: '_' at offset 4 is not a base64 character"),
            "{errs:?}"
        );
    }

    #[test]
    fn manifest_extensions() {
        assert!(is_manifest_file(Path::new("/d/a.yaml")));
        assert!(is_manifest_file(Path::new("/d/a.yml")));
        assert!(is_manifest_file(Path::new("/d/a.json")));
        assert!(!is_manifest_file(Path::new("/d/a.yaml.swp")));
        assert!(!is_manifest_file(Path::new("/d/.a.yaml")));
        assert!(!is_manifest_file(Path::new("/d/README.md")));
    }
}
