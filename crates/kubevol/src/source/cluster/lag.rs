//! The Node authorizer's lag. The API server lets a node read a Secret, a ConfigMap or a claim
//! once a pod bound to the node references it; it learns the reference from its own watch of
//! pods, moments after the pod is made — and in the order pods were made, the order the node's
//! own watch delivers them. A read for a new pod that comes in that moment is refused (403).
//!
//! Rather than every refused read trying again on its own (hundreds of refused lists when a
//! thousand pods come at once), one read at a time asks for the pods the authorizer is not
//! known to know (newer than the newest pod a read was allowed for): the reads of the others
//! wait for its answer. While nothing is refused, the one that goes is the newest waiting: if
//! it is allowed, the authorizer knows every pod up to it, and every waiting read goes at
//! once. Once one is refused, the reads of newer pods wait until it is allowed (it is tried
//! again on its backoff), and the waiting reads of older pods are asked in the middle first,
//! a binary search for the newest pod the authorizer knows. A read of a pod older than one
//! allowed is never held; no read waits longer than [`MAX_WAIT`] (the refused read's pod may
//! be gone), nor for an answer longer than [`ANSWER_WAIT`] (one lost with the connection).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::backoff::WatchBackoff;

/// The longest a read waits for another's refusal to pass.
pub(super) const MAX_WAIT: Duration = Duration::from_secs(10);

/// The longest the reads of newer pods wait for the answer to a read in flight.
pub(super) const ANSWER_WAIT: Duration = Duration::from_secs(2);

/// With [`Lag::first_alone`], how long after the last read allowed the next pods ask one at a
/// time again, as a node's first pods do: a burst of pods after a quiet spell is a first
/// burst again (its reads would otherwise all go before the first refusal came back).
pub(super) const QUIET: Duration = Duration::from_secs(30);

/// What the node knows of the authorizer's view of its pods.
#[derive(Default)]
pub(super) struct Lag {
    state: Mutex<State>,
    changed: Notify,
}

/// When reads for pods the authorizer is not known to know ask one at a time; otherwise only
/// a refusal holds the reads of newer pods.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
enum Alone {
    /// Never.
    #[default]
    Never,
    /// Until the first read is allowed (a node's first pods, which come together, would
    /// otherwise all go before the first refusal came back), and again once no read was
    /// allowed for [`QUIET`].
    First,
    /// Always.
    Always,
}

#[derive(Default)]
struct State {
    /// When reads for pods the authorizer is not known to know ask one at a time.
    alone: Alone,
    /// The number given to the next pod seen.
    next: u64,
    /// Every pod up to this one is known to the authorizer (a read for it was allowed).
    learnt: u64,
    /// When a read for a pod newer than the ones known before was last allowed.
    learnt_at: Option<Instant>,
    /// The oldest pod a read was refused for, newer than `learnt`.
    refused: Option<u64>,
    /// The read in flight for a pod newer than `learnt`: its place, and when it went.
    asking: Option<(u64, Instant)>,
    /// The places of the reads waiting for their turn (how many reads each).
    waiting: BTreeMap<u64, usize>,
}

impl State {
    /// The place of the read in flight whose answer is still awaited.
    fn asking(&self, now: Instant) -> Option<u64> {
        self.asking
            .filter(|(_, at)| now < *at + ANSWER_WAIT)
            .map(|(place, _)| place)
    }

    /// Whether a read for the pod `place` waits now.
    fn holds(&self, place: u64, now: Instant) -> bool {
        if place <= self.learnt {
            return false;
        }
        if self.refused.is_some_and(|r| place > r) {
            return true;
        }
        let alone = match self.alone {
            Alone::Never => false,
            Alone::First => self.learnt_at.is_none_or(|at| now >= at + QUIET),
            Alone::Always => true,
        };
        if !alone {
            return false;
        }
        match self.asking(now) {
            Some(asking) => asking != place,
            None => self.next_to_ask(place) != place,
        }
    }

    /// The place whose read goes next when none is in flight, of the waiting ones and
    /// `place` (which is newer than `learnt` and not newer than `refused`): the newest while
    /// nothing is refused; else the middle one of those older than the refused; else the
    /// refused one itself.
    fn next_to_ask(&self, place: u64) -> u64 {
        // Counted and walked in the waiting map, not copied: every waiting read asks this on
        // every answer, so a storm of a thousand reads would build a million vectors.
        let Some(refused) = self.refused else {
            let newest = self.waiting.range(self.learnt + 1..).next_back();
            return newest.map_or(place, |(p, _)| place.max(*p));
        };
        let below = self.learnt + 1..refused;
        let extra = below.contains(&place) && !self.waiting.contains_key(&place);
        let n = self.waiting.range(below.clone()).count() + usize::from(extra);
        if n == 0 {
            return refused;
        }
        // The middle one of the waiting places below the refused, `place` among them.
        let middle = n / 2;
        let mut waiting = self.waiting.range(below).map(|(p, _)| *p);
        if extra {
            let older = self.waiting.range(self.learnt + 1..place).count();
            match middle.cmp(&older) {
                std::cmp::Ordering::Equal => return place,
                std::cmp::Ordering::Greater => {
                    return waiting.nth(middle - 1).expect("n counts the places")
                }
                std::cmp::Ordering::Less => {}
            }
        }
        waiting.nth(middle).expect("n counts the places")
    }

    fn stop_waiting(&mut self, place: u64) {
        if let Some(n) = self.waiting.get_mut(&place) {
            *n -= 1;
            if *n == 0 {
                self.waiting.remove(&place);
            }
        }
    }
}

impl Lag {
    /// A lag whose reads for unknown pods ask one at a time (see the module's documentation);
    /// `Lag::default()` holds reads only behind a refusal.
    pub(super) fn one_at_a_time() -> Lag {
        let lag = Lag::default();
        lag.lock().alone = Alone::Always;
        lag
    }

    /// A lag that asks one at a time until a read is allowed and again after [`QUIET`]
    /// without one, and otherwise holds reads only behind a refusal.
    pub(super) fn first_alone() -> Lag {
        let lag = Lag::default();
        lag.lock().alone = Alone::First;
        lag
    }

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
    #[cfg(test)]
    fn held(&self, place: u64) -> bool {
        self.lock().holds(place, Instant::now())
    }

    /// Waits until a read for the pod `place` may go (see the module's documentation), at
    /// most [`MAX_WAIT`]; the read that then goes for a pod the authorizer is not known to
    /// know is the one whose answer the others wait for.
    pub(super) async fn turn(&self, place: u64) {
        let deadline = Instant::now() + MAX_WAIT;
        let mut waiting = false;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before the check: a change after it wakes this.
            changed.as_mut().enable();
            let wake = {
                let mut st = self.lock();
                let now = Instant::now();
                let held = st.holds(place, now);
                if !held || now >= deadline {
                    if waiting {
                        st.stop_waiting(place);
                    }
                    if place > st.learnt && st.asking(now).is_none() {
                        st.asking = Some((place, now));
                    }
                    drop(st);
                    if waiting {
                        // Which read goes next may have been this one's to say.
                        self.changed.notify_waiters();
                    }
                    return;
                }
                if !waiting {
                    *st.waiting.entry(place).or_default() += 1;
                    waiting = true;
                }
                let answer_due = st.asking.map(|(_, at)| at + ANSWER_WAIT);
                answer_due.map_or(deadline, |due| due.min(deadline))
            };
            let _ = tokio::time::timeout_at(wake.max(Instant::now()), changed).await;
        }
    }

    /// A read for the pod `place` was refused (403).
    pub(super) fn refused(&self, place: u64) {
        let mut st = self.lock();
        if place > st.learnt {
            st.refused = Some(st.refused.map_or(place, |r| r.min(place)));
        }
        if st.asking.is_some_and(|(p, _)| p == place) {
            st.asking = None;
        }
        drop(st);
        self.changed.notify_waiters();
    }

    /// A read for the pod `place` was allowed: the authorizer knows every pod up to it.
    pub(super) fn allowed(&self, place: u64) {
        let mut st = self.lock();
        if place > st.learnt {
            st.learnt = place;
            st.learnt_at = Some(Instant::now());
        }
        if st.refused.is_some_and(|r| r <= st.learnt) {
            st.refused = None;
        }
        let learnt = st.learnt;
        if st.asking.is_some_and(|(p, _)| p <= learnt) {
            st.asking = None;
        }
        drop(st);
        self.changed.notify_waiters();
    }

    /// A read for the pod `place` was answered with something that says nothing of the
    /// authorizer (the server unreachable, another error): the next read goes.
    pub(super) fn answered(&self, place: u64) {
        let mut st = self.lock();
        if st.asking.is_some_and(|(p, _)| p == place) {
            st.asking = None;
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

    /// See [`Lag::answered`].
    pub(super) fn answered(&self) {
        if let Some((lag, place)) = &self.0 {
            lag.answered(*place);
        }
    }

    /// Says what a failed read tells of the server's lag and returns when to try it again: a
    /// refusal in the lag (`lagging`) holds the reads of newer pods and is tried again on
    /// `backoff`'s short lag steps; any other failure lets the next read go and waits
    /// `backoff`'s step (`refused`: the server answered, rather than not at all).
    pub(super) fn retry_after(
        &self,
        backoff: &mut WatchBackoff,
        lagging: bool,
        refused: bool,
    ) -> Duration {
        if lagging {
            self.refused();
            backoff.step_lag()
        } else {
            self.answered();
            backoff.step(refused)
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
    async fn the_first_pods_ask_one_at_a_time_until_one_is_allowed_then_only_a_refusal_holds() {
        let lag = Arc::new(Lag::first_alone());
        let [a, b, c] = [lag.seen(), lag.seen(), lag.seen()];
        lag.turn(a).await;
        assert!(lag.held(b) && lag.held(c), "a's answer is awaited");
        lag.refused(a);
        assert!(
            lag.held(b) && lag.held(c),
            "a refused: the newer ones wait for it"
        );
        lag.turn(a).await;
        lag.allowed(a);
        assert!(
            !lag.held(b) && !lag.held(c),
            "a allowed: the rest go at once"
        );
        let d = lag.seen();
        lag.turn(b).await;
        assert!(
            !lag.held(d),
            "after the first allowed, a read in flight holds no other"
        );
        lag.refused(c);
        assert!(lag.held(d), "a refusal still holds the newer ones");
    }

    /// A burst of pods after a quiet spell asks one at a time again, as the node's first
    /// pods did; pods that come while reads are being allowed do not.
    #[tokio::test(start_paused = true)]
    async fn pods_after_a_quiet_spell_ask_one_at_a_time_again() {
        let lag = Arc::new(Lag::first_alone());
        let a = lag.seen();
        lag.turn(a).await;
        lag.allowed(a);
        tokio::time::advance(QUIET - Duration::from_secs(1)).await;
        let [b, c] = [lag.seen(), lag.seen()];
        lag.turn(c).await;
        assert!(
            !lag.held(b),
            "a read was allowed moments ago: b goes beside c"
        );
        lag.allowed(c);
        tokio::time::advance(QUIET).await;
        let [d, e] = [lag.seen(), lag.seen()];
        lag.turn(e).await;
        assert!(lag.held(d), "after a quiet spell, e's answer is awaited");
        lag.allowed(e);
        assert!(!lag.held(d), "e allowed: d goes");
        let f = lag.seen();
        assert!(!lag.held(f), "a read was allowed just now");
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

    /// Lets the spawned readers run until each waits or has gone: the paused clock moves on
    /// (by a millisecond, far from any of the lag's limits) only once every task is idle.
    async fn settle() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    fn reader(lag: &Arc<Lag>, place: u64) -> tokio::task::JoinHandle<()> {
        let lag = lag.clone();
        tokio::spawn(async move { lag.turn(place).await })
    }

    /// One read at a time asks for pods the authorizer is not known to know; while nothing is
    /// refused the newest waiting one goes next, and its being allowed lets every older one go.
    #[tokio::test(start_paused = true)]
    async fn one_read_asks_at_a_time_and_the_newest_goes_next() {
        let lag = Arc::new(Lag::one_at_a_time());
        let [a, b, c, d] = [lag.seen(), lag.seen(), lag.seen(), lag.seen()];
        lag.turn(a).await;
        let waiting = [reader(&lag, b), reader(&lag, c), reader(&lag, d)];
        settle().await;
        assert!(
            waiting.iter().all(|w| !w.is_finished()),
            "a's answer is awaited"
        );
        lag.allowed(a);
        settle().await;
        let done: Vec<bool> = waiting.iter().map(|w| w.is_finished()).collect();
        assert_eq!(done, [false, false, true], "the newest asks next");
        lag.allowed(d);
        settle().await;
        assert!(
            waiting.iter().all(|w| w.is_finished()),
            "d known: so are b and c"
        );
        assert!(!lag.held(lag.seen()), "nothing in flight, nothing refused");
    }

    /// Once the newest is refused, the older waiting reads are asked in the middle first: a
    /// binary search for the newest pod the authorizer knows, not one refusal per pod.
    #[tokio::test(start_paused = true)]
    async fn after_a_refusal_the_middle_of_the_older_ones_asks() {
        let lag = Arc::new(Lag::one_at_a_time());
        let places: Vec<u64> = (0..7).map(|_| lag.seen()).collect();
        lag.turn(places[0]).await;
        let readers: Vec<_> = places[1..].iter().map(|p| reader(&lag, *p)).collect();
        let gone = |readers: &[tokio::task::JoinHandle<()>]| -> Vec<u64> {
            readers
                .iter()
                .zip(&places[1..])
                .filter(|(r, _)| r.is_finished())
                .map(|(_, p)| *p)
                .collect()
        };
        settle().await;
        lag.answered(places[0]);
        settle().await;
        assert_eq!(gone(&readers), [7], "the newest asks");
        lag.refused(7);
        settle().await;
        assert_eq!(gone(&readers), [4, 7], "the middle of 2..=6 asks");
        lag.allowed(4);
        settle().await;
        assert_eq!(
            gone(&readers),
            [2, 3, 4, 6, 7],
            "up to 4 known; of 5 and 6, 6 asks"
        );
        lag.refused(6);
        settle().await;
        assert_eq!(gone(&readers), [2, 3, 4, 5, 6, 7]);
    }

    /// The next read to ask, walked in the waiting map, is the one the rule names, taken from a
    /// sorted copy of every candidate: over every small state (learnt, refused, the waiting
    /// places and the asking one).
    #[test]
    fn the_next_to_ask_is_the_newest_or_the_middle_below_the_refused() {
        let reference = |st: &State, place: u64| {
            let top = st.refused.unwrap_or(u64::MAX);
            let mut all: Vec<u64> = st
                .waiting
                .range(st.learnt + 1..=top)
                .map(|(p, _)| *p)
                .collect();
            if !all.contains(&place) {
                all.push(place);
                all.sort_unstable();
            }
            match st.refused {
                None => all[all.len() - 1],
                Some(r) => {
                    let below: Vec<u64> = all.into_iter().filter(|p| *p < r).collect();
                    below.get(below.len() / 2).copied().unwrap_or(r)
                }
            }
        };
        let mut checked = 0;
        for learnt in 0..3u64 {
            for refused in [None, Some(3), Some(5), Some(8)] {
                for mask in 0u32..256 {
                    let waiting: BTreeMap<u64, usize> = (1..=8)
                        .filter(|p| mask & (1 << (p - 1)) != 0)
                        .map(|p| (p, 1))
                        .collect();
                    let st = State {
                        learnt,
                        refused,
                        waiting,
                        ..State::default()
                    };
                    let top = refused.unwrap_or(8);
                    for place in learnt + 1..=top {
                        assert_eq!(
                            st.next_to_ask(place),
                            reference(&st, place),
                            "learnt {learnt}, refused {refused:?}, waiting {:?}, place {place}",
                            st.waiting.keys().collect::<Vec<_>>()
                        );
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 10_000, "{checked}");
    }

    /// An answer that never comes (a connection lost with it) holds the others no longer
    /// than [`ANSWER_WAIT`].
    #[tokio::test(start_paused = true)]
    async fn a_lost_answer_holds_the_others_only_so_long() {
        let lag = Arc::new(Lag::one_at_a_time());
        let [a, b] = [lag.seen(), lag.seen()];
        lag.turn(a).await;
        let start = Instant::now();
        lag.turn(b).await;
        assert_eq!(start.elapsed(), ANSWER_WAIT);
    }
}
