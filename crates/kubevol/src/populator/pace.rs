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

#[cfg(test)]
mod tests {
    use super::*;

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
