//! The Node authorizer's lag. The API server lets a node read a Secret, a ConfigMap or a claim
//! once a pod bound to the node references it; it learns the reference from its own watch of
//! pods, moments after the pod is made — and in the order pods were made, the order the node's
//! own watch delivers them. A read for a new pod that comes in that moment is refused (403).
//!
//! Rather than every refused read trying again on its own (hundreds of refused lists when a
//! thousand pods come at once), one read waits for all: the oldest refused one (by the order
//! the node saw the pods) is tried again on its backoff, and the reads of newer pods wait;
//! once it is allowed, the authorizer knows every pod up to it, and every waiting read goes.
//! A read of a pod older than the oldest refused one is not held (the authorizer may know it),
//! and no read waits longer than [`MAX_WAIT`] (the refused read's pod may be gone).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

/// The longest a read waits for another's refusal to pass.
pub(super) const MAX_WAIT: Duration = Duration::from_secs(10);

/// What the node knows of the authorizer's view of its pods.
#[derive(Default)]
pub(super) struct Lag {
    state: Mutex<State>,
    changed: Notify,
}

#[derive(Default)]
struct State {
    /// The number given to the next pod seen.
    next: u64,
    /// Every pod up to this one is known to the authorizer (a read for it was allowed).
    learnt: u64,
    /// The oldest pod a read was refused for, newer than `learnt`.
    refused: Option<u64>,
}

impl Lag {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        crate::sync::lock(&self.state)
    }

    /// The place of a pod seen now, in the order the node saw them (from 1).
    pub(super) fn seen(&self) -> u64 {
        let mut st = self.lock();
        st.next += 1;
        st.next
    }

    /// Whether a read for the pod `place` would be held now.
    fn held(&self, place: u64) -> bool {
        let st = self.lock();
        st.refused.is_some_and(|r| place > r && place > st.learnt)
    }

    /// Waits while reads for pods older than the pod `place` are refused (at most
    /// [`MAX_WAIT`]).
    pub(super) async fn turn(&self, place: u64) {
        let deadline = tokio::time::Instant::now() + MAX_WAIT;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before the check: a change after it wakes this.
            changed.as_mut().enable();
            if !self.held(place) {
                return;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return;
            }
        }
    }

    /// A read for the pod `place` was refused (403).
    pub(super) fn refused(&self, place: u64) {
        let mut st = self.lock();
        if place > st.learnt {
            st.refused = Some(st.refused.map_or(place, |r| r.min(place)));
        }
    }

    /// A read for the pod `place` was allowed: the authorizer knows every pod up to it.
    pub(super) fn allowed(&self, place: u64) {
        let mut st = self.lock();
        st.learnt = st.learnt.max(place);
        if st.refused.is_some_and(|r| r <= st.learnt) {
            st.refused = None;
            drop(st);
            self.changed.notify_waiters();
        }
    }
}

/// A reader's place in the authorizer's order, or none (a read the order does not decide: a
/// PersistentVolume, related to the node through its claim).
#[derive(Clone)]
pub(super) struct Place(Option<(Arc<Lag>, u64)>);

impl Place {
    /// The place `place` in `lag`'s order.
    pub(super) fn of(lag: &Arc<Lag>, place: u64) -> Self {
        Place(Some((lag.clone(), place)))
    }

    /// No place: never held, and its answers say nothing of the order.
    pub(super) fn none() -> Self {
        Place(None)
    }

    /// See [`Lag::turn`].
    pub(super) async fn turn(&self) {
        if let Some((lag, place)) = &self.0 {
            lag.turn(*place).await;
        }
    }

    /// See [`Lag::refused`].
    pub(super) fn refused(&self) {
        if let Some((lag, place)) = &self.0 {
            lag.refused(*place);
        }
    }

    /// See [`Lag::allowed`].
    pub(super) fn allowed(&self) {
        if let Some((lag, place)) = &self.0 {
            lag.allowed(*place);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_of_newer_pods_wait_for_the_oldest_refused_one() {
        let lag = Lag::default();
        let [a, b, c] = [lag.seen(), lag.seen(), lag.seen()];
        assert!(!lag.held(c), "nothing refused: every read goes");
        lag.refused(b);
        assert!(!lag.held(a), "an older pod's read is not held");
        assert!(!lag.held(b), "the refused read itself tries again");
        assert!(lag.held(c), "a newer pod's read waits");
        lag.refused(c);
        assert!(lag.held(c), "the oldest refused one stays the one tried");
        lag.allowed(a);
        assert!(lag.held(c), "an older pod allowed says nothing of b");
        lag.allowed(b);
        assert!(
            !lag.held(c),
            "b allowed: the authorizer knows every pod up to it"
        );
        lag.refused(a);
        assert!(
            !lag.held(c),
            "a refusal of a pod known to the authorizer is not its lag"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_read_goes_when_the_refused_one_is_allowed_or_after_the_longest_wait() {
        let lag = Arc::new(Lag::default());
        let [a, b] = [lag.seen(), lag.seen()];
        lag.refused(a);
        let waiting = tokio::spawn({
            let lag = lag.clone();
            async move { lag.turn(b).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        lag.allowed(a);
        tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .expect("released at once")
            .unwrap();

        let c = lag.seen();
        lag.refused(b);
        let start = tokio::time::Instant::now();
        lag.turn(c).await;
        assert_eq!(
            start.elapsed(),
            MAX_WAIT,
            "b's pod may be gone: c waits no longer"
        );
    }
}
