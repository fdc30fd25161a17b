//! The pace of content rewrites: the volumes that show one ConfigMap or Secret are written
//! again for a change of it at most once a [`CONTENT_EVERY`]. A change that comes sooner is
//! held back until then, and the changes that come meanwhile are one rewrite, of the version
//! the store has then (the latest wins). So an object patched eight times a second costs its
//! volumes one rewrite a second each, not eight, while an object changed rarely is written at
//! once. (The kubelet rewrites content volumes at each pod sync, about once a minute, whatever
//! the update rate.)

use std::collections::BTreeMap;
use std::time::Duration;

use kubevol_core::collections::HashMap;
use tokio::time::Instant;

use crate::store::ObjectKey;

/// The least time between two rewrites of an object's volumes for changes of it.
pub const CONTENT_EVERY: Duration = Duration::from_secs(1);

/// When each content object's readers were last touched, and the changes held back.
pub(super) struct Pace {
    /// The least time between two rewrites of an object's volumes.
    every: Duration,
    touched: HashMap<ObjectKey, Instant>,
    held: BTreeMap<ObjectKey, Instant>,
}

impl Default for Pace {
    fn default() -> Self {
        Pace::every(CONTENT_EVERY)
    }
}

/// Whether changes of `key` are paced: content that volumes are written from.
fn paced(key: &ObjectKey) -> bool {
    matches!(key, ObjectKey::ConfigMap(_) | ObjectKey::Secret(_))
}

impl Pace {
    /// A pace of one rewrite per `every`.
    pub(super) fn every(every: Duration) -> Pace {
        Pace {
            every,
            touched: HashMap::default(),
            held: BTreeMap::new(),
        }
    }

    /// Whether a change of `key` touches its readers now; if not, it is held back until its
    /// object's next turn. `shown` is whether the store holds the object now, so that its
    /// volumes show its content: only such a touch counts as a rewrite. A change while the
    /// object is not there (its watch started, it does not exist yet) shows nothing, and the
    /// change that brings the object, which its volumes wait for, is never held back.
    pub(super) fn admit(&mut self, key: &ObjectKey, now: Instant, shown: bool) -> bool {
        if !paced(key) {
            return true;
        }
        if self.held.contains_key(key) {
            return false;
        }
        match self.touched.get(key) {
            Some(last) if now < *last + self.every => {
                self.held.insert(key.clone(), *last + self.every);
                false
            }
            _ => {
                if shown {
                    self.touched.insert(key.clone(), now);
                } else {
                    self.touched.remove(key);
                }
                true
            }
        }
    }

    /// The changes held back whose turn has come (their readers are touched now), and the
    /// forgetting of objects not changed for a turn.
    pub(super) fn due(&mut self, now: Instant) -> Vec<ObjectKey> {
        let due: Vec<ObjectKey> = self
            .held
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for key in &due {
            self.held.remove(key);
            self.touched.insert(key.clone(), now);
        }
        self.touched.retain(|_, last| now < *last + self.every);
        due
    }

    /// When the next change held back is due.
    pub(super) fn next(&self) -> Option<Instant> {
        self.held.values().min().copied()
    }
}

/// A content volume: its pod and its name in the pod.
pub(super) type VolumeKey = (kubevol_core::PodUid, String);

/// The pace of each content volume's rewrites: at most one a [`CONTENT_EVERY`], however many of
/// the objects it reads changed (a volume of 20 Secrets, each patched once a second, was written
/// 14 times a second: each object had its own turn), and for a change of the pod's own fields
/// (a downward API item) alike. The first write of a volume is never held back.
pub(super) struct VolumePace {
    every: Duration,
    last: HashMap<VolumeKey, Instant>,
    held: BTreeMap<VolumeKey, Instant>,
}

impl Default for VolumePace {
    fn default() -> Self {
        VolumePace::every(CONTENT_EVERY)
    }
}

impl VolumePace {
    /// A pace of one rewrite per `every`.
    pub(super) fn every(every: Duration) -> VolumePace {
        VolumePace {
            every,
            last: HashMap::default(),
            held: BTreeMap::new(),
        }
    }

    /// Whether `volume` may be written again now; if not, it is held to its turn (and the
    /// rewrite then writes what the store has then).
    pub(super) fn admit(&mut self, volume: &VolumeKey, now: Instant) -> bool {
        if self.held.contains_key(volume) {
            return false;
        }
        match self.last.get(volume) {
            Some(last) if now < *last + self.every => {
                self.held.insert(volume.clone(), *last + self.every);
                false
            }
            _ => {
                self.last.insert(volume.clone(), now);
                true
            }
        }
    }

    /// Notes a first write of `volume` (it starts its pace; it is not held).
    pub(super) fn wrote(&mut self, volume: &VolumeKey, now: Instant) {
        self.last.insert(volume.clone(), now);
    }

    /// The volumes held back whose turn has come (written now), and the forgetting of volumes
    /// not written for a turn.
    pub(super) fn due(&mut self, now: Instant) -> Vec<VolumeKey> {
        let due: Vec<VolumeKey> = self
            .held
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(k, _)| k.clone())
            .collect();
        for key in &due {
            self.held.remove(key);
            self.last.insert(key.clone(), now);
        }
        self.last.retain(|_, last| now < *last + self.every);
        due
    }

    /// When the next volume held back is due.
    pub(super) fn next(&self) -> Option<Instant> {
        self.held.values().min().copied()
    }

    /// Forgets the volumes of a pod that is gone.
    pub(super) fn forget_pod(&mut self, uid: &kubevol_core::PodUid) {
        self.held.retain(|(u, _), _| u != uid);
        self.last.retain(|(u, _), _| u != uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rewrites of one volume, whatever asks for them, are one a turn; volumes are paced
    /// apart; a first write starts the pace without being held.
    #[tokio::test(start_paused = true)]
    async fn a_volume_is_written_again_at_most_once_a_turn() {
        let mut pace = VolumePace::default();
        let v = |n: &str| (kubevol_core::PodUid("u".into()), n.to_string());
        let (a, b) = (v("a"), v("b"));
        let start = Instant::now();
        pace.wrote(&a, start);
        for ms in [1, 100, 999] {
            assert!(
                !pace.admit(&a, start + Duration::from_millis(ms)),
                "held within the turn"
            );
        }
        assert!(pace.admit(&b, start), "per volume");
        assert_eq!(
            pace.next(),
            Some(start + CONTENT_EVERY),
            "one turn for all of a's"
        );
        assert!(pace.due(start + Duration::from_millis(999)).is_empty());
        assert_eq!(pace.due(start + CONTENT_EVERY), vec![a.clone()]);
        assert!(!pace.admit(&a, start + CONTENT_EVERY + Duration::from_millis(1)));
        // Quiet for a turn: the next rewrite goes at once.
        let later = start + CONTENT_EVERY * 4;
        assert_eq!(pace.due(later), vec![a.clone()]);
        assert!(pace.due(later + CONTENT_EVERY * 2).is_empty());
        assert!(pace.admit(&a, later + CONTENT_EVERY * 2));
        pace.forget_pod(&a.0);
        assert!(pace.last.is_empty() && pace.held.is_empty());
    }

    fn config_map(name: &str) -> ObjectKey {
        ObjectKey::ConfigMap(("ns".to_string(), name.to_string()))
    }

    #[tokio::test(start_paused = true)]
    async fn changes_of_an_object_are_one_rewrite_a_second_the_first_at_once() {
        let mut pace = Pace::default();
        let (a, b) = (config_map("a"), config_map("b"));
        let start = Instant::now();
        assert!(
            pace.admit(&a, start, true),
            "a rare change is written at once"
        );
        assert!(pace.admit(&b, start, true), "per object");
        assert_eq!(pace.next(), None);
        for ms in [100, 200, 900] {
            let now = start + Duration::from_millis(ms);
            assert!(!pace.admit(&a, now, true), "held back within the second");
            assert!(pace.due(now).is_empty());
            assert_eq!(
                pace.next(),
                Some(start + CONTENT_EVERY),
                "one turn for them all"
            );
        }
        let turn = start + CONTENT_EVERY;
        assert_eq!(pace.due(turn), std::slice::from_ref(&a));
        assert_eq!(pace.next(), None);
        assert!(
            !pace.admit(&a, turn + Duration::from_millis(10), true),
            "the next turn is a second after this one"
        );
        assert_eq!(pace.next(), Some(turn + CONTENT_EVERY));
        assert!(pace.due(turn + CONTENT_EVERY).contains(&a));
        // Quiet for a turn: forgotten, and the next change is written at once.
        let later = turn + CONTENT_EVERY * 3;
        assert!(pace.due(later).is_empty());
        assert!(
            pace.touched.is_empty() && pace.held.is_empty(),
            "nothing kept of quiet objects"
        );
        assert!(pace.admit(&a, later, true));
    }

    #[test]
    fn only_content_is_paced() {
        let mut pace = Pace::default();
        let now = Instant::now();
        for key in [
            ObjectKey::Pod(kubevol_core::PodUid("u".into())),
            ObjectKey::PersistentVolume("pv".into()),
        ] {
            assert!(
                pace.admit(&key, now, true) && pace.admit(&key, now, true),
                "{key:?}"
            );
        }
        let secret = ObjectKey::Secret(("ns".to_string(), "s".to_string()));
        assert!(pace.admit(&secret, now, true));
        assert!(!pace.admit(&secret, now, true));
    }

    /// A change while the object is not there (its watch has started) shows nothing, so the
    /// change that brings it, which its volumes wait for, is not held back, however soon it
    /// comes; once content has been shown, the next change waits its turn.
    #[tokio::test(start_paused = true)]
    async fn a_change_before_the_content_is_shown_holds_nothing_back() {
        let mut pace = Pace::default();
        let a = config_map("a");
        let start = Instant::now();
        assert!(pace.admit(&a, start, false), "pending, not there yet");
        let soon = start + Duration::from_millis(5);
        assert!(pace.admit(&a, soon, true), "listed: shown at once");
        assert_eq!(pace.next(), None);
        assert!(
            !pace.admit(&a, soon + Duration::from_millis(5), true),
            "a rewrite of shown content waits its turn"
        );
        assert_eq!(pace.next(), Some(soon + CONTENT_EVERY));
    }
}
