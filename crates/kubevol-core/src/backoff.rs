//! Per-key exponential backoff, as a small value type.
//!
//! The kubelet waits 500 ms after a failed volume operation, doubling on each further failure up
//! to 2 min 2 s, and forgets the delay on success. The executor keeps one [`Backoff`] per
//! operation key; this module never reads a clock, the caller passes `now`.

use std::time::{Duration, Instant};

/// How long to wait after failures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackoffPolicy {
    /// Delay after the first failure.
    pub initial: Duration,
    /// Upper bound of the delay.
    pub max: Duration,
}

impl BackoffPolicy {
    /// The kubelet's values: 500 ms doubling to 2 min 2 s.
    pub const KUBELET: BackoffPolicy = BackoffPolicy {
        initial: Duration::from_millis(500),
        max: Duration::from_secs(122),
    };
}

impl BackoffPolicy {
    /// Retrying a source or a driver that is not there yet: 500 ms doubling to 30 s.
    pub const RECONNECT: BackoffPolicy = BackoffPolicy {
        initial: Duration::from_millis(500),
        max: Duration::from_secs(30),
    };

    /// The delays between the attempts of one retry loop: `initial`, doubling up to `max`.
    pub fn delays(self) -> impl Iterator<Item = Duration> {
        std::iter::successors(Some(self.initial.min(self.max)), move |d| {
            Some(d.saturating_mul(2).min(self.max))
        })
    }
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        Self::KUBELET
    }
}

/// The backoff state of one key after at least one failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// When the last failure happened.
    pub last_failure: Instant,
    /// How long after `last_failure` the key may run again.
    pub delay: Duration,
    /// Consecutive failures so far.
    pub failures: u32,
}

impl Backoff {
    /// The state after a first failure at `now`.
    pub fn first(policy: BackoffPolicy, now: Instant) -> Self {
        Backoff {
            last_failure: now,
            delay: policy.initial.min(policy.max),
            failures: 1,
        }
    }

    /// Records one more failure at `now`: the delay doubles, up to the policy's maximum.
    pub fn fail(prev: Option<Backoff>, policy: BackoffPolicy, now: Instant) -> Self {
        match prev {
            None => Backoff::first(policy, now),
            Some(b) => Backoff {
                last_failure: now,
                delay: b.delay.saturating_mul(2).min(policy.max),
                failures: b.failures.saturating_add(1),
            },
        }
    }

    /// The first instant the key may run again.
    pub fn ready_at(&self) -> Instant {
        self.last_failure + self.delay
    }

    /// Whether the key may run at `now`.
    pub fn is_ready(&self, now: Instant) -> bool {
        now >= self.ready_at()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delay_doubles_from_half_a_second_to_two_minutes_two_seconds() {
        let p = BackoffPolicy::KUBELET;
        let t0 = Instant::now();
        let mut b = Backoff::first(p, t0);
        let mut seen = vec![b.delay];
        for _ in 0..12 {
            b = Backoff::fail(Some(b), p, t0);
            seen.push(b.delay);
        }
        assert_eq!(seen[0], Duration::from_millis(500));
        assert_eq!(seen[1], Duration::from_secs(1));
        assert_eq!(seen[2], Duration::from_secs(2));
        assert_eq!(seen[7], Duration::from_secs(64));
        assert_eq!(seen[8], Duration::from_secs(122), "capped at 2m2s");
        assert_eq!(*seen.last().unwrap(), Duration::from_secs(122));
        assert_eq!(b.failures, 13);
    }

    #[test]
    fn retry_loop_delays_double_up_to_the_maximum() {
        let seen: Vec<u64> = BackoffPolicy::RECONNECT
            .delays()
            .take(9)
            .map(|d| d.as_millis() as u64)
            .collect();
        assert_eq!(
            seen,
            [500, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000]
        );
    }

    #[test]
    fn ready_only_after_delay() {
        let p = BackoffPolicy {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(4),
        };
        let t0 = Instant::now();
        let b = Backoff::first(p, t0);
        assert!(!b.is_ready(t0));
        assert!(!b.is_ready(t0 + Duration::from_millis(999)));
        assert!(b.is_ready(t0 + Duration::from_secs(1)));
    }
}
