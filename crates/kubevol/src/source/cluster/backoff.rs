//! The retry delays of the watches, readers and publishers, and what every task of this
//! folder is held by.

use std::time::Duration;

use kube::runtime::watcher;
use tokio::task::JoinHandle;

use crate::error::ApiError;

/// The retry delays of the watches, reads and publishers: 0.5 s, doubling up to 8 s while the
/// server cannot be reached (a node whose API server is back should learn of the pods deleted
/// meanwhile soon), and up to 30 s while it refuses (a forbidden or failing request is not
/// made better by asking again soon: client-go's reflectors wait up to 30 s), with ±25 %
/// jitter so that many nodes do not retry in step against a recovering server; a read for a pod
/// refused by the Node authorizer's lag (403) from 0.25 s, doubling up to 8 s (the reads of
/// newer pods wait for it: see `lag`). Reset only by a
/// success: a watch's complete listing, a read, a publication (kube-runtime's own backoff is
/// reset by the `Init` event that comes before every list, so it never grew).
pub(super) struct WatchBackoff {
    next: Duration,
    /// The delay after the next 403 of a read for a pod (the Node authorizer's lag).
    next_lag: Duration,
}

impl WatchBackoff {
    const FIRST: Duration = Duration::from_millis(500);
    const MAX: Duration = Duration::from_secs(8);
    const MAX_REFUSED: Duration = Duration::from_secs(30);
    /// The first delay after a 403 of a read for a pod: the authorizer learns a pod in
    /// moments, and reads for newer pods wait for this one (see `lag`).
    const FIRST_LAG: Duration = Duration::from_millis(250);

    /// The delay before the next try after a 403 of a read for a pod: 0.25 s, doubling up to
    /// 8 s, with the same jitter.
    pub(super) fn step_lag(&mut self) -> Duration {
        let base = self.next_lag.min(Self::MAX);
        self.next_lag = (base * 2).min(Self::MAX);
        jittered(base)
    }

    /// The delay before the next try, after a failure (`refused`: the server answered with
    /// an error, rather than not at all).
    pub(super) fn step(&mut self, refused: bool) -> Duration {
        let cap = if refused {
            Self::MAX_REFUSED
        } else {
            Self::MAX
        };
        let base = self.next.min(cap);
        self.next = (base * 2).min(cap);
        jittered(base)
    }

    pub(super) fn reset(&mut self) {
        *self = WatchBackoff::default();
    }
}

/// `base` times a factor in [0.75, 1.25).
fn jittered(base: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    base.mul_f64(0.75 + f64::from(nanos % 1000) / 2000.0)
}

impl Default for WatchBackoff {
    fn default() -> Self {
        WatchBackoff {
            next: Self::FIRST,
            next_lag: Self::FIRST_LAG,
        }
    }
}

/// Whether a watch's failure is the server's answer (refused, or an error status), rather
/// than the server not being reached.
pub(super) fn refused(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => api_refused(e),
        watcher::Error::WatchError(_) | watcher::Error::NoResourceVersion => true,
    }
}

/// Whether a request's failure is the server's answer rather than the server not reached.
fn api_refused(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(_))
}

/// Whether a failed read of an object a pod references should slow down to the refused pace:
/// the server answered with an error, but not `403` — that is the Node authorizer not yet
/// having learnt that a new pod references the object, which it does within moments, so the
/// read is tried again on the quick schedule (a 30 s step there held pods back by tens of
/// seconds when 400 objects came at once).
pub(super) fn object_refused(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(_)) && !forbidden(e)
}

/// Whether the server refused the request as forbidden (403).
pub(super) fn forbidden(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 403)
}

/// [`forbidden`] for a watch's failure.
pub(super) fn watch_forbidden(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => forbidden(e),
        watcher::Error::WatchError(s) => s.code == 403,
        watcher::Error::NoResourceVersion => false,
    }
}

/// [`object_refused`] for a watch's failure.
pub(super) fn object_watch_refused(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => object_refused(e),
        watcher::Error::WatchError(_) | watcher::Error::NoResourceVersion => !watch_forbidden(e),
    }
}

/// A task aborted when this is dropped.
pub(super) struct AbortOnDrop(pub(super) JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A failed request as the node's parts act on it: `what` says what was asked ("cannot read
/// Node n"), the error's text follows. A `400`/`422` is refused; a `403` is waited for (the
/// Node authorizer allows a node an object once one of its pods uses it, moments after the
/// pod); a `404` is what `not_found` says (there is no such API, or the object is not made
/// yet); a conflict, throttling, a server error or a failed connection is tried again.
pub(crate) fn api_error(
    what: impl std::fmt::Display,
    e: &kube::Error,
    not_found: fn(String) -> ApiError,
) -> ApiError {
    let message = format!("{what}: {e}");
    match e {
        kube::Error::Api(s) if s.code == 404 => not_found(message),
        kube::Error::Api(s) if s.code == 403 => ApiError::Waiting(message),
        kube::Error::Api(s) if matches!(s.code, 409 | 429) || s.code >= 500 => {
            ApiError::Unavailable(message)
        }
        kube::Error::Api(_) => ApiError::Refused(message),
        _ => ApiError::Unavailable(message),
    }
}
