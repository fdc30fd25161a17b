//! The operation executor's bookkeeping: single-flight per key, per-key exponential backoff,
//! and the last error of each key for the status API and the waiters.
//!
//! At most one operation runs per (volume, pod) key, and a volume-wide operation (mount device,
//! detach) excludes every pod operation on the same volume, as the kubelet's nested pending
//! operations do. A failing key backs off alone; other keys are unaffected. This type holds no
//! lock across an await: callers reserve a key, run the operation, and report the result.
//!
//! A key turned away because a conflicting operation was running is remembered until that
//! operation finishes, and `finish` says so: the caller must plan again then, or the work the
//! planner asked for would wait for the next resync.

use std::collections::BTreeMap;

use kubevol_core::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::SystemTime;

use kubevol_core::backoff::{Backoff, BackoffPolicy};
use kubevol_core::reconcile::OperationKey;
use kubevol_core::{PodUid, UniqueVolumeName};
use tokio::time::Instant;

/// Why an operation was not started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotStarted {
    /// An operation on the same key (or a conflicting one) is running.
    Busy,
    /// The key failed recently and may run again at this instant.
    BackingOff(Instant),
}

/// The last failure of a key.
#[derive(Clone, Debug)]
pub struct LastError {
    /// The message, naming pod, volume and what to do.
    pub message: String,
    /// When it happened.
    pub at: SystemTime,
    /// When the key may run again.
    pub retry_at: Instant,
    /// Consecutive failures.
    pub failures: u32,
    /// Whether it cannot clear without a change of the pod or the node's configuration (see
    /// [`VolumeError::is_permanent`](crate::error::VolumeError::is_permanent)): the key is not
    /// retried on a timer, only when its pod or an object the pod reads changes.
    pub permanent: bool,
}

/// How a failed operation ended: its message (naming pod, volume and what to do), and whether
/// the failure is permanent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The message.
    pub message: String,
    /// See [`LastError::permanent`].
    pub permanent: bool,
}

impl From<String> for Failure {
    /// A failure that may clear by itself.
    fn from(message: String) -> Self {
        Failure {
            message,
            permanent: false,
        }
    }
}

/// How long a permanent failure's key waits when nothing changes: for good, in practice.
const PERMANENT: std::time::Duration = std::time::Duration::from_secs(100 * 365 * 24 * 3600);

#[derive(Default)]
struct State {
    /// Running keys, each with whether its operation tears something down (one table for
    /// both: a node's teardown storm would otherwise grow a second table of every key).
    running: HashMap<OperationKey, bool>,
    volume_wide: HashSet<UniqueVolumeName>,
    pod_ops: HashMap<UniqueVolumeName, usize>,
    backoff: HashMap<OperationKey, Backoff>,
    errors: BTreeMap<OperationKey, LastError>,
    /// When each key's operation last succeeded (for a set-up, when the volume's content was
    /// last written).
    succeeded: HashMap<OperationKey, SystemTime>,
    /// Keys turned away as busy, by volume (every conflict is within one volume).
    turned_away: HashMap<UniqueVolumeName, HashSet<Option<PodUid>>>,
}

/// The bookkeeping.
pub struct Executor {
    policy: BackoffPolicy,
    state: Mutex<State>,
}

/// Converts the runtime's instant (which a paused test clock controls) to the pure core's.
fn std_instant(i: Instant) -> std::time::Instant {
    i.into_std()
}

impl Executor {
    /// An executor with a backoff policy.
    pub fn new(policy: BackoffPolicy) -> Self {
        Executor {
            policy,
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        crate::sync::lock(&self.state)
    }

    /// Reserves `key` if nothing conflicting runs and its backoff has expired.
    pub fn try_start(&self, key: &OperationKey, now: Instant) -> Result<(), NotStarted> {
        let mut s = self.lock();
        let conflict = s.running.contains_key(key)
            || s.volume_wide.contains(&key.volume)
            || (key.pod.is_none() && s.pod_ops.get(&key.volume).copied().unwrap_or(0) > 0);
        if conflict {
            s.turned_away
                .entry(key.volume.clone())
                .or_default()
                .insert(key.pod.clone());
            return Err(NotStarted::Busy);
        }
        if let Some(b) = s.backoff.get(key) {
            if !b.is_ready(std_instant(now)) {
                let wait = b.ready_at() - std_instant(now);
                return Err(NotStarted::BackingOff(now + wait));
            }
        }
        s.running.insert(key.clone(), false);
        if key.pod.is_none() {
            s.volume_wide.insert(key.volume.clone());
        } else {
            *s.pod_ops.entry(key.volume.clone()).or_default() += 1;
        }
        Ok(())
    }

    /// Releases each key with its operation's outcome, under one lock (a batch of operations
    /// that ended together): success clears its backoff and error, failure doubles its backoff
    /// and records the message. Returns whether a key one of them kept from starting was
    /// turned away meanwhile (it may start now: plan again).
    #[must_use = "a key turned away while these ran waits for a new plan"]
    pub fn finish_all(
        &self,
        ended: impl IntoIterator<Item = (OperationKey, Result<(), Failure>)>,
        now: Instant,
    ) -> bool {
        let mut s = self.lock();
        let mut blocked = false;
        for (key, outcome) in ended {
            blocked |= s.finish(self.policy, &key, outcome, now);
        }
        blocked
    }

    /// Notes that the operation started for `key` tears something down: until it finishes,
    /// a pod that wants the volume again is not ready (see [`Executor::tearing_down`]).
    pub fn mark_teardown(&self, key: &OperationKey) {
        let mut s = self.lock();
        if let Some(teardown) = s.running.get_mut(key) {
            *teardown = true;
        }
    }

    /// Whether a teardown of `key` has been started and has not finished.
    pub fn tearing_down(&self, key: &OperationKey) -> bool {
        self.lock().running.get(key).copied().unwrap_or(false)
    }

    /// Reports that the running operation of `key` has not finished in time (a hung
    /// filesystem or driver): the status shows `message` while the key stays reserved, so no
    /// second call piles onto the hung one.
    pub fn report_stalled(&self, key: &OperationKey, message: String, now: Instant) {
        let mut s = self.lock();
        let failures = s.errors.get(key).map(|e| e.failures).unwrap_or(0);
        s.errors.insert(
            key.clone(),
            LastError {
                message,
                at: SystemTime::now(),
                retry_at: now,
                failures,
                permanent: false,
            },
        );
    }

    /// The last error of a key, if its last run failed.
    pub fn last_error(&self, key: &OperationKey) -> Option<LastError> {
        self.lock().errors.get(key).cloned()
    }

    /// The last error of any key of a volume (pod key first, then the volume-wide key).
    pub fn last_error_for(
        &self,
        volume: &UniqueVolumeName,
        pod: &kubevol_core::PodUid,
    ) -> Option<LastError> {
        let s = self.lock();
        s.errors
            .get(&OperationKey {
                volume: volume.clone(),
                pod: Some(pod.clone()),
            })
            .or_else(|| {
                s.errors.get(&OperationKey {
                    volume: volume.clone(),
                    pod: None,
                })
            })
            .cloned()
    }

    /// Lets the keys `which` selects run again at once (something they were waiting for has
    /// changed): their backoff is cleared, their last error stays until the next attempt.
    pub fn retry_now(&self, which: impl Fn(&OperationKey) -> bool, now: Instant) {
        let mut s = self.lock();
        s.backoff.retain(|k, _| !which(k));
        for (_, e) in s.errors.iter_mut().filter(|(k, _)| which(k)) {
            e.retry_at = e.retry_at.min(now);
            e.permanent = false;
        }
    }

    /// Lets the keys `which` selects whose last failure was permanent run again at once (their
    /// pod changed, which may have fixed it); keys backing off from other failures keep their
    /// backoff.
    pub fn retry_permanent_now(&self, which: impl Fn(&OperationKey) -> bool, now: Instant) {
        let mut s = self.lock();
        let State {
            errors, backoff, ..
        } = &mut *s;
        for (k, e) in errors.iter_mut().filter(|(k, e)| e.permanent && which(k)) {
            backoff.remove(k);
            e.retry_at = e.retry_at.min(now);
            e.permanent = false;
        }
    }

    /// Forgets errors and backoff of keys for which `keep` is false (their volume and pod are
    /// gone from both states of world).
    pub fn retain(&self, keep: impl Fn(&OperationKey) -> bool) {
        let mut s = self.lock();
        s.errors.retain(|k, _| keep(k));
        s.backoff.retain(|k, _| keep(k));
        s.succeeded.retain(|k, _| keep(k));
    }

    /// When the operation of `key` last succeeded.
    pub fn last_success(&self, key: &OperationKey) -> Option<SystemTime> {
        self.lock().succeeded.get(key).copied()
    }
}

impl State {
    /// One key of [`Executor::finish_all`], under the executor's lock.
    fn finish(
        &mut self,
        policy: BackoffPolicy,
        key: &OperationKey,
        outcome: Result<(), Failure>,
        now: Instant,
    ) -> bool {
        self.running.remove(key);
        let mut blocked = false;
        if let Some(waiting) = self.turned_away.get_mut(&key.volume) {
            // The same key, or any key of the volume when one of the two is volume-wide.
            waiting.retain(|pod| {
                let conflicts = key.pod.is_none() || pod.is_none() || *pod == key.pod;
                blocked |= conflicts;
                !conflicts
            });
            if waiting.is_empty() {
                self.turned_away.remove(&key.volume);
            }
        }
        if key.pod.is_none() {
            self.volume_wide.remove(&key.volume);
        } else if let Some(n) = self.pod_ops.get_mut(&key.volume) {
            *n -= 1;
            if *n == 0 {
                self.pod_ops.remove(&key.volume);
            }
        }
        match outcome {
            Ok(()) => {
                self.backoff.remove(key);
                self.errors.remove(key);
                self.succeeded.insert(key.clone(), SystemTime::now());
            }
            Err(Failure { message, permanent }) => {
                let prev = self.backoff.get(key).copied();
                let mut b = Backoff::fail(prev, policy, std_instant(now));
                if permanent {
                    b.delay = PERMANENT;
                }
                let retry_at = now + b.delay;
                self.backoff.insert(key.clone(), b);
                self.errors.insert(
                    key.clone(),
                    LastError {
                        message,
                        at: SystemTime::now(),
                        retry_at,
                        failures: b.failures,
                        permanent,
                    },
                );
            }
        }
        blocked
    }
}

#[cfg(test)]
impl Executor {
    /// One key released alone.
    #[must_use]
    fn finish(&self, key: &OperationKey, outcome: Result<(), String>, now: Instant) -> bool {
        self.finish_all([(key.clone(), outcome.map_err(Failure::from))], now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kubevol_core::PodUid;
    use std::time::Duration;

    fn key(v: &str, p: Option<&str>) -> OperationKey {
        OperationKey {
            volume: UniqueVolumeName(v.into()),
            pod: p.map(|p| PodUid(p.into())),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn one_operation_per_key_and_volume_wide_excludes_pod_keys() {
        let e = Executor::new(BackoffPolicy::KUBELET);
        let now = Instant::now();
        assert!(e.try_start(&key("v", Some("a")), now).is_ok());
        assert_eq!(
            e.try_start(&key("v", Some("a")), now),
            Err(NotStarted::Busy)
        );
        assert!(
            e.try_start(&key("v", Some("b")), now).is_ok(),
            "another pod of the same volume may run"
        );
        assert_eq!(
            e.try_start(&key("v", None), now),
            Err(NotStarted::Busy),
            "volume-wide waits for pod ops"
        );
        assert!(
            e.finish(&key("v", Some("a")), Ok(()), now),
            "a was turned away while it ran, and the volume-wide key too"
        );
        assert!(
            !e.finish(&key("v", Some("b")), Ok(()), now),
            "already reported by a's finish"
        );
        assert!(e.try_start(&key("v", None), now).is_ok());
        assert_eq!(
            e.try_start(&key("v", Some("c")), now),
            Err(NotStarted::Busy),
            "pod ops wait for volume-wide"
        );
        assert!(
            e.try_start(&key("w", Some("c")), now).is_ok(),
            "other volumes are unaffected"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_permanent_failure_waits_for_a_change_of_its_pod_not_a_timer() {
        let e = Executor::new(BackoffPolicy::KUBELET);
        let now = Instant::now();
        let (k, other) = (key("v", Some("a")), key("w", Some("a")));
        for key in [&k, &other] {
            e.try_start(key, now).unwrap();
        }
        let failure = Failure {
            message: "needs an API server".into(),
            permanent: true,
        };
        assert!(!e.finish_all([(k.clone(), Err(failure))], now));
        let _ = e.finish(&other, Err("busy".into()), now);
        let last = e.last_error(&k).unwrap();
        assert!(last.permanent);
        let a_day = now + std::time::Duration::from_secs(86_400);
        assert!(
            matches!(e.try_start(&k, a_day), Err(NotStarted::BackingOff(_))),
            "no retry on a timer"
        );
        // The pod changed: only the permanent failure runs again at once; the other keeps its
        // backoff.
        e.retry_permanent_now(|key| key.pod == Some(PodUid("a".into())), now);
        assert!(!e.last_error(&k).unwrap().permanent);
        assert!(e.try_start(&k, now).is_ok());
        assert!(matches!(
            e.try_start(&other, now),
            Err(NotStarted::BackingOff(_))
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_teardown_is_known_until_it_finishes() {
        let e = Executor::new(BackoffPolicy::KUBELET);
        let now = Instant::now();
        let k = key("v", Some("a"));
        e.mark_teardown(&k);
        assert!(!e.tearing_down(&k), "only a started key");
        e.try_start(&k, now).unwrap();
        e.mark_teardown(&k);
        assert!(e.tearing_down(&k));
        assert!(!e.tearing_down(&key("v", Some("b"))));
        let _ = e.finish(&k, Err("busy".into()), now);
        assert!(!e.tearing_down(&k), "failed or not, it is over");
    }

    #[tokio::test(start_paused = true)]
    async fn retry_now_clears_backoff_and_keeps_the_last_error() {
        let e = Executor::new(BackoffPolicy::KUBELET);
        let now = Instant::now();
        let (a, b) = (key("v", Some("a")), key("v", Some("b")));
        for k in [&a, &b] {
            e.try_start(k, now).unwrap();
            assert!(!e.finish(k, Err("configMap default/x not found".into()), now));
        }
        assert!(matches!(
            e.try_start(&a, now),
            Err(NotStarted::BackingOff(_))
        ));
        e.retry_now(|k| k.pod.as_ref().is_some_and(|p| p.as_str() == "a"), now);
        assert!(e.try_start(&a, now).is_ok(), "a may run at once");
        assert_eq!(
            e.last_error(&a).unwrap().message,
            "configMap default/x not found"
        );
        assert_eq!(e.last_error(&a).unwrap().retry_at, now);
        assert!(
            matches!(e.try_start(&b, now), Err(NotStarted::BackingOff(_))),
            "b still backs off"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn failing_key_backs_off_alone_and_doubles() {
        let e = Executor::new(BackoffPolicy::KUBELET);
        let k = key("v", Some("a"));
        let t0 = Instant::now();
        e.try_start(&k, t0).unwrap();
        assert!(!e.finish(&k, Err("boom".into()), t0));
        assert_eq!(
            e.try_start(&k, t0),
            Err(NotStarted::BackingOff(t0 + Duration::from_millis(500)))
        );
        assert!(
            e.try_start(&key("v", Some("b")), t0).is_ok(),
            "other keys run"
        );
        tokio::time::advance(Duration::from_millis(500)).await;
        let t1 = Instant::now();
        e.try_start(&k, t1).unwrap();
        assert!(!e.finish(&k, Err("boom".into()), t1));
        assert_eq!(
            e.try_start(&k, t1),
            Err(NotStarted::BackingOff(t1 + Duration::from_secs(1)))
        );
        assert_eq!(e.last_error(&k).unwrap().failures, 2);
        tokio::time::advance(Duration::from_secs(1)).await;
        e.try_start(&k, Instant::now()).unwrap();
        assert!(!e.finish(&k, Ok(()), Instant::now()));
        assert!(e.last_error(&k).is_none(), "success clears the error");
        assert!(e.try_start(&k, Instant::now()).is_ok(), "and the backoff");
    }

    #[tokio::test(start_paused = true)]
    async fn finishing_says_whether_it_kept_a_wanted_key_waiting() {
        let e = Executor::new(BackoffPolicy::KUBELET);
        let now = Instant::now();
        let (a, b) = (key("v", Some("a")), key("v", Some("b")));
        e.try_start(&a, now).unwrap();
        e.try_start(&b, now).unwrap();
        assert!(!e.finish(&b, Ok(()), now), "nothing asked for b meanwhile");
        e.try_start(&b, now).unwrap();
        assert_eq!(e.try_start(&a, now), Err(NotStarted::Busy));
        assert!(
            !e.finish(&b, Ok(()), now),
            "a was turned away by its own run, not by b"
        );
        assert!(e.finish(&a, Ok(()), now), "a was asked for while it ran");
        e.try_start(&a, now).unwrap();
        assert!(!e.finish(&a, Ok(()), now), "reported once");

        // A pod key waiting for a volume-wide operation, and the other way round.
        let whole = key("v", None);
        e.try_start(&whole, now).unwrap();
        assert_eq!(e.try_start(&a, now), Err(NotStarted::Busy));
        assert_eq!(
            e.try_start(&key("w", Some("a")), now),
            Ok(()),
            "another volume"
        );
        assert!(e.finish(&whole, Ok(()), now));
        e.try_start(&a, now).unwrap();
        assert_eq!(e.try_start(&whole, now), Err(NotStarted::Busy));
        assert!(
            !e.finish(&key("w", Some("a")), Ok(()), now),
            "another volume's key"
        );
        assert!(e.finish(&a, Err("boom".into()), now), "failed or not");
    }

    /// Keys released together are released as one at a time would be: each free again, each
    /// failure backing off, and a key turned away meanwhile reported.
    #[tokio::test(start_paused = true)]
    async fn keys_finished_together_are_released_as_one_by_one() {
        let e = Executor::new(BackoffPolicy::KUBELET);
        let now = Instant::now();
        for k in [key("v", Some("a")), key("w", Some("b"))] {
            e.try_start(&k, now).unwrap();
        }
        assert!(!e.finish_all(
            [
                (key("v", Some("a")), Ok(())),
                (key("w", Some("b")), Err(String::from("boom").into())),
            ],
            now
        ));
        assert!(e.try_start(&key("v", Some("a")), now).is_ok());
        assert!(matches!(
            e.try_start(&key("w", Some("b")), now),
            Err(NotStarted::BackingOff(_))
        ));
        assert_eq!(
            e.try_start(&key("v", Some("a")), now),
            Err(NotStarted::Busy),
            "turned away"
        );
        assert!(e.finish_all([(key("v", Some("a")), Ok(()))], now));
    }
}
