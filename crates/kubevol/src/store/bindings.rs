//! The claims kubevol has bound to PersistentVolumes, as a cluster's PersistentVolume
//! controller would (standalone mode and the library: the API server's claims are bound by
//! the cluster).
//!
//! A binding is made once, when a pod first uses an unbound claim, and kept for good in
//! `<root>/volume-record/bindings.json`: a restart, an edit of the claim or of other volumes
//! (a smaller one that would fit better), even the claim's removal from the manifests, never
//! moves a claim to another volume, and a volume bound to one claim is never given to
//! another. A claim is known by its namespace, name and UID, as the PersistentVolume
//! controller knows it (`claimRef.uid`): a claim that comes back (the same UID: a claim of the
//! manifests without one has one derived from its name) finds its volume, with its data; a
//! claim of the same name and another UID (the claim made for another pod's ephemeral volume)
//! is another claim, and never inherits it. A volume whose claim is gone stays reserved for
//! it (the PersistentVolume controller's `Released`, as with the `Retain` policy). The file is replaced whole (written beside, flushed, renamed, the
//! directory flushed), so a crash leaves the old bindings or the new, never a torn file.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use k8s_openapi::api::core::v1::PersistentVolume;
use serde::{Deserialize, Serialize};

/// The bindings file, in the record's directory.
pub const BINDINGS_FILE: &str = "bindings.json";

/// The file format's version.
const VERSION: u32 = 1;

/// One binding.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Binding {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub claim: String,
    /// The claim's UID (a file written before UIDs were kept has none: it is the UID derived
    /// from the namespace and name).
    #[serde(default)]
    pub uid: String,
    /// The PersistentVolume's name.
    pub volume: String,
    /// When it was made (seconds since the epoch).
    pub bound_at: u64,
}

#[derive(Serialize, Deserialize)]
struct File {
    version: u32,
    bindings: Vec<Binding>,
    /// The volumes kubevol provisioned (each bound to its claim above).
    #[serde(default)]
    provisioned: Vec<PersistentVolume>,
}

/// The bindings (each claim known by its namespace, name and UID).
#[derive(Default)]
pub struct Bindings {
    /// Where they are kept (`None`: in memory only, for a store without a root).
    path: Option<PathBuf>,
    map: Mutex<State>,
    /// Provisioned volumes being deleted (their claim is gone): nothing may use them.
    releasing: Mutex<std::collections::BTreeSet<String>>,
    /// Claims whose volume a CSI driver is creating, and the last failure of each.
    creating: Mutex<BTreeMap<(String, String), Creating>>,
    /// Why the binder could not bind each claim it tried, by claim: their pods say it.
    unbound: Mutex<BTreeMap<(String, String), String>>,
}

/// A volume being created for a claim.
#[derive(Clone, Debug, Default)]
pub struct Creating {
    /// A CreateVolume call is out.
    pub in_flight: bool,
    /// Failed calls so far.
    pub failures: u32,
    /// The last failure.
    pub last_error: Option<String>,
    /// No call before this, after a failure (1 s, doubling to a minute).
    pub retry_at: Option<std::time::Instant>,
}

/// The bindings and the volumes provisioned, by volume name.
#[derive(Clone, Default)]
struct State {
    bindings: BTreeMap<String, Binding>,
    provisioned: BTreeMap<String, PersistentVolume>,
}

impl Bindings {
    /// The bindings kept under `root` (none yet if the file does not exist). A file that
    /// cannot be read is an error: binding claims without knowing the old bindings could give
    /// a claim's volume to another.
    pub fn load(root: &Path) -> std::io::Result<Self> {
        let path = root.join(crate::record::RECORD_DIR).join(BINDINGS_FILE);
        let mut state = State::default();
        match std::fs::read(&path) {
            Ok(bytes) => {
                let file: File = serde_json::from_slice(&bytes).map_err(|e| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!(
                            "{} cannot be read ({e}): it holds which PersistentVolume each claim was bound to; restore it, or move it away to bind claims anew",
                            path.display()
                        ),
                    )
                })?;
                if file.version != VERSION {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!(
                            "{} has version {}, this kubevol reads {VERSION}",
                            path.display(),
                            file.version
                        ),
                    ));
                }
                for mut b in file.bindings {
                    if b.uid.is_empty() {
                        b.uid = super::derived_claim_uid(&b.namespace, &b.claim);
                    }
                    state.bindings.insert(b.volume.clone(), b);
                }
                for pv in file.provisioned {
                    state
                        .provisioned
                        .insert(pv.metadata.name.clone().unwrap_or_default(), pv);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        Ok(Bindings {
            path: Some(path),
            map: Mutex::new(state),
            releasing: Mutex::default(),
            creating: Mutex::default(),
            unbound: Mutex::default(),
        })
    }

    /// The volume claim `namespace/name` of UID `uid` is bound to.
    pub fn volume_of(&self, namespace: &str, claim: &str, uid: &str) -> Option<String> {
        crate::sync::lock(&self.map)
            .bindings
            .values()
            .find(|b| b.is(namespace, claim, uid))
            .map(|b| b.volume.clone())
    }

    /// The claim (`namespace/name`) volume `volume` is bound to.
    pub fn claim_of(&self, volume: &str) -> Option<String> {
        self.binding_of(volume)
            .map(|b| format!("{}/{}", b.namespace, b.claim))
    }

    /// The binding of volume `volume`.
    pub fn binding_of(&self, volume: &str) -> Option<Binding> {
        crate::sync::lock(&self.map).bindings.get(volume).cloned()
    }

    /// Every binding, by claim.
    pub fn all(&self) -> Vec<Binding> {
        let mut all: Vec<Binding> = crate::sync::lock(&self.map)
            .bindings
            .values()
            .cloned()
            .collect();
        all.sort_by(|a, b| (&a.namespace, &a.claim, &a.uid).cmp(&(&b.namespace, &b.claim, &b.uid)));
        all
    }

    /// The volumes kubevol provisioned.
    pub fn provisioned(&self) -> Vec<PersistentVolume> {
        crate::sync::lock(&self.map)
            .provisioned
            .values()
            .cloned()
            .collect()
    }

    /// Whether kubevol provisioned any volume.
    pub fn has_provisioned(&self) -> bool {
        !crate::sync::lock(&self.map).provisioned.is_empty()
    }

    /// Provisioned volume `name`, if kubevol made it.
    pub fn provisioned_volume(&self, name: &str) -> Option<PersistentVolume> {
        crate::sync::lock(&self.map).provisioned.get(name).cloned()
    }

    /// Binds claim `namespace/claim` of UID `uid` to `volume`, on disk before it counts.
    /// Refused if either is bound already.
    pub fn bind(
        &self,
        namespace: &str,
        claim: &str,
        uid: &str,
        volume: &str,
    ) -> std::io::Result<()> {
        self.bind_new((namespace, claim, uid), volume, None)
    }

    /// Records `pv`, provisioned for claim `namespace/claim` of UID `uid`, and binds them, in
    /// one write.
    pub fn provision(
        &self,
        namespace: &str,
        claim: &str,
        uid: &str,
        pv: PersistentVolume,
    ) -> std::io::Result<()> {
        let name = pv.metadata.name.clone().unwrap_or_default();
        self.bind_new((namespace, claim, uid), &name, Some(pv))
    }

    /// Marks claim `namespace/claim`'s volume as being created: its state before, or `None`
    /// when a call is already out, or a failed one's backoff has not passed.
    pub fn start_creating(&self, namespace: &str, claim: &str) -> Option<Creating> {
        let mut creating = crate::sync::lock(&self.creating);
        let c = creating
            .entry((namespace.to_string(), claim.to_string()))
            .or_default();
        if c.in_flight || c.retry_at.is_some_and(|t| std::time::Instant::now() < t) {
            return None;
        }
        let before = c.clone();
        c.in_flight = true;
        Some(before)
    }

    /// How the creation of claim `namespace/claim`'s volume stands.
    pub fn creating(&self, namespace: &str, claim: &str) -> Option<Creating> {
        crate::sync::lock(&self.creating)
            .get(&(namespace.to_string(), claim.to_string()))
            .cloned()
    }

    /// Ends a creation: done (forgotten), or failed with `error`; then returns how long until
    /// it may be tried again (1 s, doubling to a minute).
    pub fn finish_creating(
        &self,
        namespace: &str,
        claim: &str,
        error: Option<String>,
    ) -> Option<std::time::Duration> {
        let mut creating = crate::sync::lock(&self.creating);
        let key = (namespace.to_string(), claim.to_string());
        let e = match error {
            None => {
                creating.remove(&key);
                return None;
            }
            Some(e) => e,
        };
        let c = creating.entry(key).or_default();
        c.in_flight = false;
        c.failures += 1;
        c.last_error = Some(e);
        let delay = std::time::Duration::from_secs(1 << (c.failures - 1).min(6))
            .min(std::time::Duration::from_secs(60));
        c.retry_at = Some(std::time::Instant::now() + delay);
        Some(delay)
    }

    /// Records why the binder could not bind claim `namespace/claim`, or that nothing keeps
    /// it from being bound (`None`); says whether that changed.
    pub fn set_unbound(&self, namespace: &str, claim: &str, why: Option<String>) -> bool {
        let mut unbound = crate::sync::lock(&self.unbound);
        let key = (namespace.to_string(), claim.to_string());
        match why {
            Some(why) => unbound
                .insert(key, why.clone())
                .is_none_or(|was| was != why),
            None => unbound.remove(&key).is_some(),
        }
    }

    /// Why the binder could not bind claim `namespace/claim`, if it tried and could not.
    pub fn why_unbound(&self, namespace: &str, claim: &str) -> Option<String> {
        crate::sync::lock(&self.unbound)
            .get(&(namespace.to_string(), claim.to_string()))
            .cloned()
    }

    /// Marks provisioned volume `volume` as being deleted; false if it already is.
    pub fn start_release(&self, volume: &str) -> bool {
        crate::sync::lock(&self.releasing).insert(volume.to_string())
    }

    /// Whether provisioned volume `volume` is being deleted.
    pub fn is_releasing(&self, volume: &str) -> bool {
        crate::sync::lock(&self.releasing).contains(volume)
    }

    /// Forgets provisioned volume `volume` and its binding (its data is gone), on disk; or,
    /// with `done: false`, gives up deleting it for now.
    pub fn finish_release(&self, volume: &str, done: bool) -> std::io::Result<()> {
        let result = if done {
            let mut map = crate::sync::lock(&self.map);
            let mut next = map.clone();
            next.provisioned.remove(volume);
            next.bindings.remove(volume);
            let written = match &self.path {
                Some(path) => write_whole(path, &next),
                None => Ok(()),
            };
            if written.is_ok() {
                *map = next;
            }
            written
        } else {
            Ok(())
        };
        crate::sync::lock(&self.releasing).remove(volume);
        result
    }

    /// Replaces the record of provisioned volume `pv` (its capacity grew), on disk.
    pub fn update_provisioned(&self, pv: PersistentVolume) -> std::io::Result<()> {
        let name = pv.metadata.name.clone().unwrap_or_default();
        let mut map = crate::sync::lock(&self.map);
        if !map.provisioned.contains_key(&name) {
            return Err(std::io::Error::other(format!(
                "PersistentVolume {name} is not one kubevol provisioned"
            )));
        }
        let mut next = map.clone();
        next.provisioned.insert(name, pv);
        if let Some(path) = &self.path {
            write_whole(path, &next)?;
        }
        *map = next;
        Ok(())
    }

    fn bind_new(
        &self,
        (namespace, claim, uid): (&str, &str, &str),
        volume: &str,
        provisioned: Option<PersistentVolume>,
    ) -> std::io::Result<()> {
        let mut map = crate::sync::lock(&self.map);
        if let Some(b) = map.bindings.values().find(|b| b.is(namespace, claim, uid)) {
            return Err(std::io::Error::other(format!(
                "claim {namespace}/{claim} is bound to PersistentVolume {} already",
                b.volume
            )));
        }
        if let Some(b) = map.bindings.get(volume) {
            return Err(std::io::Error::other(format!(
                "PersistentVolume {volume} is bound to claim {}/{} already",
                b.namespace, b.claim
            )));
        }
        let binding = Binding {
            namespace: namespace.to_string(),
            claim: claim.to_string(),
            uid: uid.to_string(),
            volume: volume.to_string(),
            bound_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        };
        let mut next = map.clone();
        next.bindings.insert(volume.to_string(), binding);
        if let Some(pv) = provisioned {
            next.provisioned.insert(volume.to_string(), pv);
        }
        crate::record::fail_point("bind", "before");
        if let Some(path) = &self.path {
            write_whole(path, &next)?;
        }
        crate::record::fail_point("bind", "after");
        *map = next;
        Ok(())
    }
}

impl Binding {
    /// Whether this binding is of claim `namespace/claim` of UID `uid`.
    pub fn is(&self, namespace: &str, claim: &str, uid: &str) -> bool {
        self.namespace == namespace && self.claim == claim && self.uid == uid
    }
}

/// Replaces the file at `path` with `state`: written beside it, flushed, renamed over it, and
/// the directory flushed.
fn write_whole(path: &Path, state: &State) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let text = serde_json::to_vec_pretty(&File {
        version: VERSION,
        bindings: state.bindings.values().cloned().collect(),
        provisioned: state.provisioned.values().cloned().collect(),
    })
    .map_err(std::io::Error::other)?;
    let tmp = path.with_extension("json.new");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&text)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bindings_are_kept_across_loads_and_never_doubled() {
        let root = tempfile::tempdir().unwrap();
        let b = Bindings::load(root.path()).unwrap();
        assert!(b.all().is_empty());
        b.bind("ns", "data", "u1", "pv-1").unwrap();
        assert!(
            b.bind("ns", "data", "u1", "pv-2").is_err(),
            "a claim is bound once"
        );
        let e = b.bind("ns", "other", "u2", "pv-1").unwrap_err();
        assert_eq!(
            e.to_string(),
            "PersistentVolume pv-1 is bound to claim ns/data already"
        );
        let again = Bindings::load(root.path()).unwrap();
        assert_eq!(again.volume_of("ns", "data", "u1").as_deref(), Some("pv-1"));
        assert_eq!(again.claim_of("pv-1").as_deref(), Some("ns/data"));
        assert_eq!(again.volume_of("ns", "other", "u2"), None);
        // Another claim of the same name (another UID) is not this one's heir, and may be
        // bound to a volume of its own.
        assert_eq!(again.volume_of("ns", "data", "u3"), None);
        again.bind("ns", "data", "u3", "pv-3").unwrap();
        assert_eq!(again.volume_of("ns", "data", "u1").as_deref(), Some("pv-1"));
        assert_eq!(again.volume_of("ns", "data", "u3").as_deref(), Some("pv-3"));

        std::fs::write(
            root.path()
                .join(crate::record::RECORD_DIR)
                .join(BINDINGS_FILE),
            "{",
        )
        .unwrap();
        let e = Bindings::load(root.path()).err().unwrap();
        assert!(e.to_string().contains("cannot be read"), "{e}");
    }

    #[test]
    fn provisioned_volumes_are_kept_with_their_binding() {
        let root = tempfile::tempdir().unwrap();
        let b = Bindings::load(root.path()).unwrap();
        let pv: PersistentVolume = serde_json::from_value(
            serde_json::json!({"metadata": {"name": "pvc-1"}, "spec": {"local": {"path": "/x"}}}),
        )
        .unwrap();
        b.provision("ns", "data", "u1", pv.clone()).unwrap();
        let again = Bindings::load(root.path()).unwrap();
        assert_eq!(again.provisioned(), [pv]);
        assert_eq!(
            again.volume_of("ns", "data", "u1").as_deref(),
            Some("pvc-1")
        );
        assert!(again.start_release("pvc-1"));
        assert!(!again.start_release("pvc-1"), "one release at a time");
        assert!(again.is_releasing("pvc-1"));
        again.finish_release("pvc-1", true).unwrap();
        assert!(!again.is_releasing("pvc-1"));
        let last = Bindings::load(root.path()).unwrap();
        assert!(last.provisioned().is_empty() && last.all().is_empty());
    }

    /// A file written before claims' UIDs were kept: each binding is of the claim of its name
    /// without a UID of its own (the UID derived from its namespace and name).
    #[test]
    fn a_binding_without_a_uid_is_the_named_claims_of_the_derived_uid() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join(crate::record::RECORD_DIR);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join(BINDINGS_FILE),
            r#"{"version": 1, "bindings": [{"namespace": "ns", "claim": "data", "volume": "pv-1", "boundAt": 1}]}"#,
        )
        .unwrap();
        let b = Bindings::load(root.path()).unwrap();
        let derived = super::super::derived_claim_uid("ns", "data");
        assert_eq!(b.volume_of("ns", "data", &derived).as_deref(), Some("pv-1"));
        assert_eq!(b.volume_of("ns", "data", "another"), None);
    }

    fn pv(name: &str, size: &str) -> PersistentVolume {
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}, "spec": {"capacity": {"storage": size}, "local": {"path": "/x"}}}))
            .unwrap()
    }

    #[test]
    fn a_bindings_file_that_cannot_be_read_is_an_error_and_a_missing_one_is_none() {
        let root = tempfile::tempdir().unwrap();
        assert!(
            Bindings::load(root.path()).unwrap().all().is_empty(),
            "no file: no bindings"
        );
        // A directory where the file should be: reading it fails, and that is no "none yet".
        let file = root
            .path()
            .join(crate::record::RECORD_DIR)
            .join(BINDINGS_FILE);
        std::fs::create_dir_all(&file).unwrap();
        assert!(Bindings::load(root.path()).is_err());
    }

    #[test]
    fn every_binding_is_listed_by_claim() {
        let b = Bindings::default();
        b.bind("ns-b", "x", "u1", "pv-1").unwrap();
        b.bind("ns-a", "z", "u2", "pv-2").unwrap();
        b.bind("ns-a", "y", "u3", "pv-3").unwrap();
        let all: Vec<(String, String, String)> = b
            .all()
            .into_iter()
            .map(|b| (b.namespace, b.claim, b.volume))
            .collect();
        let want = [
            ("ns-a", "y", "pv-3"),
            ("ns-a", "z", "pv-2"),
            ("ns-b", "x", "pv-1"),
        ]
        .map(|(n, c, v)| (n.to_string(), c.to_string(), v.to_string()));
        assert_eq!(all, want);
    }

    #[test]
    fn provisioned_volumes_are_told_by_name_and_updated_only_if_kubevols() {
        let root = tempfile::tempdir().unwrap();
        let b = Bindings::load(root.path()).unwrap();
        assert!(!b.has_provisioned());
        b.bind("ns", "static", "u0", "static-pv").unwrap();
        assert!(
            !b.has_provisioned(),
            "a bound volume is not a provisioned one"
        );
        b.provision("ns", "data", "u1", pv("pvc-1", "1Gi")).unwrap();
        assert!(b.has_provisioned());
        assert_eq!(b.provisioned_volume("pvc-1"), Some(pv("pvc-1", "1Gi")));
        assert_eq!(b.provisioned_volume("static-pv"), None);

        let e = b.update_provisioned(pv("static-pv", "2Gi")).unwrap_err();
        assert!(e.to_string().contains("not one kubevol provisioned"), "{e}");
        b.update_provisioned(pv("pvc-1", "2Gi")).unwrap();
        let again = Bindings::load(root.path()).unwrap();
        assert_eq!(
            again.provisioned_volume("pvc-1"),
            Some(pv("pvc-1", "2Gi")),
            "kept on disk"
        );
        assert_eq!(again.provisioned_volume("static-pv"), None);
    }

    #[test]
    fn a_creation_is_one_call_at_a_time_and_failures_back_off_from_a_second_to_a_minute() {
        let b = Bindings::default();
        assert!(b.creating("ns", "data").is_none());
        let before = b.start_creating("ns", "data").expect("the first call");
        assert!(!before.in_flight && before.failures == 0);
        assert!(b.creating("ns", "data").unwrap().in_flight);
        assert!(
            b.start_creating("ns", "data").is_none(),
            "one call at a time"
        );
        assert!(b.start_creating("ns", "other").is_some(), "per claim");

        let mut delays = Vec::new();
        for n in 1..=8u32 {
            let delay = b
                .finish_creating("ns", "data", Some(format!("failure {n}")))
                .unwrap();
            delays.push(delay.as_secs());
            let c = b.creating("ns", "data").unwrap();
            assert_eq!((c.in_flight, c.failures), (false, n));
            assert_eq!(
                c.last_error.as_deref(),
                Some(format!("failure {n}").as_str())
            );
            assert!(
                b.start_creating("ns", "data").is_none(),
                "not before its backoff passed"
            );
        }
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(b.finish_creating("ns", "data", None), None);
        assert!(b.creating("ns", "data").is_none(), "done: forgotten");
        assert!(b.start_creating("ns", "data").is_some());
    }

    #[test]
    fn why_a_claim_is_unbound_is_kept_and_each_change_told() {
        let b = Bindings::default();
        assert!(!b.set_unbound("ns", "c", None), "nothing to clear");
        assert!(b.set_unbound("ns", "c", Some("no volume fits".into())));
        assert!(
            !b.set_unbound("ns", "c", Some("no volume fits".into())),
            "the same reason"
        );
        assert!(b.set_unbound("ns", "c", Some("another reason".into())));
        assert_eq!(b.why_unbound("ns", "c").as_deref(), Some("another reason"));
        assert_eq!(b.why_unbound("ns", "d"), None);
        assert!(b.set_unbound("ns", "c", None));
        assert_eq!(b.why_unbound("ns", "c"), None);
    }
}
