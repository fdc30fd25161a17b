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
#[derive(Default)]
pub(super) struct Pace {
    touched: HashMap<ObjectKey, Instant>,
    held: BTreeMap<ObjectKey, Instant>,
}

/// Whether changes of `key` are paced: content that volumes are written from.
fn paced(key: &ObjectKey) -> bool {
    matches!(key, ObjectKey::ConfigMap(_) | ObjectKey::Secret(_))
}

impl Pace {
    /// Whether a change of `key` touches its readers now; if not, it is held back until its
    /// object's next turn.
    pub(super) fn admit(&mut self, key: &ObjectKey, now: Instant) -> bool {
        if !paced(key) {
            return true;
        }
        if self.held.contains_key(key) {
            return false;
        }
        match self.touched.get(key) {
            Some(last) if now < *last + CONTENT_EVERY => {
                self.held.insert(key.clone(), *last + CONTENT_EVERY);
                false
            }
            _ => {
                self.touched.insert(key.clone(), now);
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
        self.touched.retain(|_, last| now < *last + CONTENT_EVERY);
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
        assert!(pace.admit(&a, start), "a rare change is written at once");
        assert!(pace.admit(&b, start), "per object");
        assert_eq!(pace.next(), None);
        for ms in [100, 200, 900] {
            let now = start + Duration::from_millis(ms);
            assert!(!pace.admit(&a, now), "held back within the second");
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
            !pace.admit(&a, turn + Duration::from_millis(10)),
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
        assert!(pace.admit(&a, later));
    }

    #[test]
    fn only_content_is_paced() {
        let mut pace = Pace::default();
        let now = Instant::now();
        for key in [
            ObjectKey::Pod(kubevol_core::PodUid("u".into())),
            ObjectKey::PersistentVolume("pv".into()),
        ] {
            assert!(pace.admit(&key, now) && pace.admit(&key, now), "{key:?}");
        }
        let secret = ObjectKey::Secret(("ns".to_string(), "s".to_string()));
        assert!(pace.admit(&secret, now));
        assert!(!pace.admit(&secret, now));
    }
}
