//! The health of volumes and of the CSI drivers' storage, as the drivers report it
//! (NodeGetVolumeHealth and NodeGetStorageHealth, CSI 1.13; `CSIVolumeHealth` in Kubernetes):
//! kept per pod volume and per driver, shown in the status and `describe`, posted as events and
//! metrics, and (in cluster mode) written to the pods' `status.volumeHealth` and the CSINode's
//! `status.storageHealth`.
//!
//! A pod volume has an entry from the first time its driver reports a condition; the entry
//! stays, with no conditions, once they clear (the pod's status keeps saying the volume
//! recovered, and when). A change is a change of the set of (status, reason): a message alone
//! that changes is kept but changes nothing, as the kubelet's status manager compares.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use kubevol_core::{PodRef, PodUid};
use serde::{Deserialize, Serialize};

/// The most conditions kept per volume or driver (the API's limit on both lists).
pub const MAX_CONDITIONS: usize = 16;
/// The longest reason kept, in bytes (the API's limit).
pub const MAX_REASON: usize = 256;
/// The longest message kept, in bytes (the API's limit).
pub const MAX_MESSAGE: usize = 1024;

/// Event reasons of volume health.
pub mod reason {
    /// A volume's driver reports an adverse condition.
    pub const VOLUME_CONDITION_ABNORMAL: &str = "VolumeConditionAbnormal";
    /// A volume's adverse conditions have cleared.
    pub const VOLUME_CONDITION_NORMAL: &str = "VolumeConditionNormal";
}

/// One adverse condition of a volume or of a driver's storage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Condition {
    /// `Inaccessible`, `DataLoss` or `Degraded` for a volume; `StorageUnreachable` or
    /// `StorageDegraded` for storage.
    pub status: String,
    /// The driver's CamelCase reason.
    pub reason: String,
    /// The driver's message.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// The access mode a storage condition is limited to (`ReadWriteOnce`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_mode: Option<String>,
    /// The volume mode a storage condition is limited to (`Filesystem` or `Block`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_mode: Option<String>,
    /// When a storage condition first appeared (seconds since the epoch; 0 for a volume's,
    /// whose time is its volume's).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub since: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Condition {
    /// A condition with `status`, `reason` and `message`, cut to the API's limits.
    pub fn new(status: &str, reason: &str, message: &str) -> Condition {
        Condition {
            status: status.to_string(),
            reason: cut(reason, MAX_REASON),
            message: cut(message, MAX_MESSAGE),
            access_mode: None,
            volume_mode: None,
            since: 0,
        }
    }

    /// What makes two conditions the same condition.
    fn identity(&self) -> (&str, &str, Option<&str>, Option<&str>) {
        (
            &self.status,
            &self.reason,
            self.access_mode.as_deref(),
            self.volume_mode.as_deref(),
        )
    }
}

impl std::fmt::Display for Condition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.status, self.reason)?;
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        Ok(())
    }
}

/// `s` cut to at most `max` bytes, at a character boundary.
fn cut(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// Whether `a` and `b` hold the same conditions (messages and order aside).
fn same(a: &[Condition], b: &[Condition]) -> bool {
    fn set(c: &[Condition]) -> BTreeSet<(&str, &str, Option<&str>, Option<&str>)> {
        c.iter().map(Condition::identity).collect()
    }
    set(a) == set(b)
}

/// The health of one pod volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeHealth {
    /// The adverse conditions now (none: the volume recovered).
    pub conditions: Vec<Condition>,
    /// When the set of conditions last changed (seconds since the epoch).
    pub since: u64,
}

#[derive(Default)]
struct Inner {
    /// By pod and the pod's name of the volume.
    volumes: BTreeMap<(PodUid, String), (PodRef, VolumeHealth)>,
    /// By driver; a driver with no conditions has no entry.
    storage: BTreeMap<String, Vec<Condition>>,
}

/// The health of the node's volumes and storage.
pub struct Health {
    inner: Mutex<Inner>,
    changed: tokio::sync::watch::Sender<u64>,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            inner: Mutex::default(),
            changed: tokio::sync::watch::channel(0).0,
        }
    }
}

/// `secs` since the epoch in the API's time format (RFC 3339).
pub fn rfc3339(secs: u64) -> String {
    jiff::Timestamp::from_second(secs as i64)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// What a report of a pod volume's health changed, for the caller's event.
#[derive(Debug, PartialEq, Eq)]
pub enum Change {
    /// The same conditions as before (or none, never any before).
    None,
    /// Conditions that were not there before: a warning.
    Abnormal(String),
    /// The conditions cleared.
    Recovered,
}

impl Health {
    /// Notified after every change.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n += 1);
    }

    /// Takes what the driver reports of volume `volume` of `pod` now.
    pub fn set_volume(&self, pod: &PodRef, volume: &str, mut conditions: Vec<Condition>) -> Change {
        conditions.truncate(MAX_CONDITIONS);
        let change = {
            let mut inner = crate::sync::lock(&self.inner);
            let key = (pod.uid.clone(), volume.to_string());
            match inner.volumes.get_mut(&key) {
                Some((_, h)) if same(&h.conditions, &conditions) => {
                    h.conditions = conditions;
                    return Change::None;
                }
                None if conditions.is_empty() => return Change::None,
                _ => {}
            }
            let change = if conditions.is_empty() {
                Change::Recovered
            } else {
                Change::Abnormal(
                    conditions
                        .iter()
                        .map(Condition::to_string)
                        .collect::<Vec<_>>()
                        .join("; "),
                )
            };
            inner.volumes.insert(
                key,
                (
                    pod.clone(),
                    VolumeHealth {
                        conditions,
                        since: now_secs(),
                    },
                ),
            );
            change
        };
        self.bump();
        change
    }

    /// Forgets the volumes `keep` says no (their pods are gone, or no longer use them).
    pub fn retain(&self, keep: impl Fn(&PodUid, &str) -> bool) {
        let removed = {
            let mut inner = crate::sync::lock(&self.inner);
            let before = inner.volumes.len();
            inner.volumes.retain(|(uid, v), _| keep(uid, v));
            before != inner.volumes.len()
        };
        if removed {
            self.bump();
        }
    }

    /// Forgets the storage of drivers `keep` says no (no longer registered).
    pub fn retain_storage(&self, keep: impl Fn(&str) -> bool) {
        let removed = {
            let mut inner = crate::sync::lock(&self.inner);
            let before = inner.storage.len();
            inner.storage.retain(|d, _| keep(d));
            before != inner.storage.len()
        };
        if removed {
            self.bump();
        }
    }

    /// Takes what `driver` reports of its storage now; whether that changed anything. A
    /// condition that was there before keeps its time.
    pub fn set_storage(&self, driver: &str, mut conditions: Vec<Condition>) -> bool {
        conditions.truncate(MAX_CONDITIONS);
        let changed = {
            let mut inner = crate::sync::lock(&self.inner);
            let before = inner.storage.get(driver).map_or(&[][..], Vec::as_slice);
            let now = now_secs();
            for c in &mut conditions {
                c.since = before
                    .iter()
                    .find(|b| b.identity() == c.identity())
                    .map_or(now, |b| b.since);
            }
            let changed = !same(before, &conditions);
            if conditions.is_empty() {
                inner.storage.remove(driver);
            } else {
                inner.storage.insert(driver.to_string(), conditions);
            }
            changed
        };
        if changed {
            self.bump();
        }
        changed
    }

    /// The health of volume `volume` of pod `uid`, if its driver ever reported a condition.
    pub fn volume(&self, uid: &PodUid, volume: &str) -> Option<VolumeHealth> {
        let inner = crate::sync::lock(&self.inner);
        inner
            .volumes
            .get(&(uid.clone(), volume.to_string()))
            .map(|(_, h)| h.clone())
    }

    /// Every pod with a volume that has (or had) conditions, with those volumes by name.
    pub fn pods(&self) -> BTreeMap<PodUid, (PodRef, BTreeMap<String, VolumeHealth>)> {
        let inner = crate::sync::lock(&self.inner);
        let mut out: BTreeMap<PodUid, (PodRef, BTreeMap<String, VolumeHealth>)> = BTreeMap::new();
        for ((uid, volume), (pod, h)) in &inner.volumes {
            out.entry(uid.clone())
                .or_insert_with(|| (pod.clone(), BTreeMap::new()))
                .1
                .insert(volume.clone(), h.clone());
        }
        out
    }

    /// The drivers whose storage has conditions, with them.
    pub fn storage(&self) -> BTreeMap<String, Vec<Condition>> {
        crate::sync::lock(&self.inner).storage.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> PodRef {
        PodRef {
            namespace: "ns".into(),
            name: "p".into(),
            uid: PodUid::from("u1"),
        }
    }

    #[test]
    fn a_volume_is_reported_once_per_change_of_its_conditions() {
        let h = Health::default();
        let mut seen = h.subscribe();
        assert_eq!(h.set_volume(&pod(), "data", vec![]), Change::None);
        assert!(
            h.pods().is_empty(),
            "no entry until a condition is reported"
        );
        assert!(!seen.has_changed().unwrap());

        let gone = Condition::new("Inaccessible", "BackingFileMissing", "no file");
        let change = h.set_volume(&pod(), "data", vec![gone.clone()]);
        assert_eq!(
            change,
            Change::Abnormal("Inaccessible (BackingFileMissing): no file".into())
        );
        assert!(seen.has_changed().unwrap());
        seen.borrow_and_update();

        // Only the message changed: kept, but no change.
        let reworded = Condition::new("Inaccessible", "BackingFileMissing", "still no file");
        assert_eq!(h.set_volume(&pod(), "data", vec![reworded]), Change::None);
        assert!(!seen.has_changed().unwrap());
        let kept = h.volume(&PodUid::from("u1"), "data").unwrap();
        assert_eq!(kept.conditions[0].message, "still no file");

        assert_eq!(h.set_volume(&pod(), "data", vec![]), Change::Recovered);
        let recovered = h.volume(&PodUid::from("u1"), "data").unwrap();
        assert!(recovered.conditions.is_empty(), "the entry stays, empty");

        h.retain(|_, v| v != "data");
        assert!(h.pods().is_empty());
    }

    #[test]
    fn storage_conditions_replace_the_drivers_and_clear_to_nothing() {
        let h = Health::default();
        let c = Condition::new("StorageUnreachable", "Gone", "");
        assert!(h.set_storage("d", vec![c.clone()]));
        assert!(!h.set_storage("d", vec![c]));
        assert_eq!(h.storage().len(), 1);
        assert!(h.set_storage("d", vec![]));
        assert!(h.storage().is_empty());
    }

    #[test]
    fn a_drivers_strings_are_cut_to_the_apis_limits() {
        let long = "é".repeat(1000);
        let c = Condition::new("Degraded", &long, &long);
        assert!(c.reason.len() <= MAX_REASON && c.reason.chars().all(|ch| ch == 'é'));
        assert!(c.message.len() <= MAX_MESSAGE);
        let h = Health::default();
        let many = (0..40)
            .map(|i| Condition::new("Degraded", &format!("R{i}"), ""))
            .collect();
        h.set_volume(&pod(), "v", many);
        let kept = h.volume(&PodUid::from("u1"), "v").unwrap();
        assert_eq!(kept.conditions.len(), MAX_CONDITIONS);
    }

    proptest::proptest! {
        /// Whatever a driver says (its strings are not kubevol's), a condition keeps a prefix of
        /// it within the API's limits, cut at a character boundary.
        #[test]
        fn any_drivers_strings_are_kept_within_the_apis_limits(
            reason in proptest::prelude::any::<String>(),
            message in "\\PC{0,2000}",
        ) {
            let c = Condition::new("Degraded", &reason, &message);
            proptest::prop_assert!(c.reason.len() <= MAX_REASON && reason.starts_with(&c.reason));
            proptest::prop_assert!(c.message.len() <= MAX_MESSAGE && message.starts_with(&c.message));
            proptest::prop_assert!(reason.len() <= MAX_REASON || c.reason.len() + 4 > MAX_REASON);
        }
    }
}
