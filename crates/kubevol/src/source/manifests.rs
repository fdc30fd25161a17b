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

use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, PersistentVolumeClaim, Pod, Secret};
use k8s_openapi::api::storage::v1::CSIDriver;
use notify::Watcher;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::store::{
    normalize_pod, normalize_secret, ManifestError, Object, ObjectName, ObjectStore,
    DEFAULT_NAMESPACE,
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
        match serde_json::from_value::<T>(value) {
            Ok(t) => Some(t),
            Err(e) => {
                let (loc, mut msg) = relocate(kind).unwrap_or((None, e.to_string()));
                if kind == "Secret" && msg.starts_with("data.") {
                    msg.push_str(
                        " (values under data are base64; put plain text under stringData)",
                    );
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

/// The manifest-directory source.
#[derive(Clone)]
pub struct ManifestSource {
    dir: PathBuf,
    store: Arc<ObjectStore>,
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
        Ok(ManifestSource { dir, store })
    }

    /// The directory read.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads one file (or forgets it, if it is gone) into the store.
    pub fn load_file(&self, path: &Path) {
        if !is_manifest_file(path) {
            return;
        }
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                info!(file = %path.display(), "manifest removed");
                self.store.remove_file(path);
                return;
            }
            Err(e) => {
                let err = manifest_error(path, None, None, format!("cannot read: {e}"));
                warn!("{err}");
                self.store.set_file_errors(path, vec![err]);
                return;
            }
        };
        let (objects, errors) = parse_manifest(path, &text);
        for e in &errors {
            warn!("{e}");
        }
        if errors.is_empty() {
            debug!(file = %path.display(), objects = objects.len(), "manifest loaded");
            self.store.replace_file(path, objects, errors);
        } else {
            // A file with any error is not applied: what it delivered before stays, so a
            // half-written edit never takes a running pod's volumes away.
            self.store.set_file_errors(path, errors);
        }
    }

    /// Reads every manifest file, and forgets files that are gone.
    pub fn load_all(&self) -> std::io::Result<()> {
        let mut present = BTreeSet::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let path = entry?.path();
            if is_manifest_file(&path) {
                present.insert(path.clone());
                self.load_file(&path);
            }
        }
        for known in self.store.known_files() {
            if known.starts_with(&self.dir) && !present.contains(&known) {
                self.store.remove_file(&known);
            }
        }
        Ok(())
    }

    /// Starts watching the directory, reads it once completely, marks the source synced, and
    /// then applies every change as inotify reports it, until the returned task is dropped or
    /// aborted.
    pub fn start(self) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let (tx, mut rx) = mpsc::unbounded_channel::<notify::Result<notify::Event>>();
        let mut watcher = notify::recommended_watcher(move |ev| {
            let _ = tx.send(ev);
        })
        .map_err(std::io::Error::other)?;
        // Watch before the first listing, so no change between the two is lost.
        watcher
            .watch(&self.dir, notify::RecursiveMode::NonRecursive)
            .map_err(std::io::Error::other)?;
        self.load_all()?;
        self.store.mark_source_synced(Self::NAME);
        info!(dir = %self.dir.display(), "manifest directory listed");
        Ok(tokio::spawn(async move {
            let _watcher = watcher;
            while let Some(first) = rx.recv().await {
                let mut batch = vec![first];
                while let Ok(more) = rx.try_recv() {
                    batch.push(more);
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
                let this = self.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    if rescan {
                        if let Err(e) = this.load_all() {
                            warn!(dir = %this.dir.display(), "cannot list manifest directory: {e}");
                        }
                    } else {
                        for p in paths {
                            this.load_file(&p);
                        }
                    }
                })
                .await;
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
    fn manifest_extensions() {
        assert!(is_manifest_file(Path::new("/d/a.yaml")));
        assert!(is_manifest_file(Path::new("/d/a.yml")));
        assert!(is_manifest_file(Path::new("/d/a.json")));
        assert!(!is_manifest_file(Path::new("/d/a.yaml.swp")));
        assert!(!is_manifest_file(Path::new("/d/.a.yaml")));
        assert!(!is_manifest_file(Path::new("/d/README.md")));
    }
}
