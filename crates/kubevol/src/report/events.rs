//! Events about pods, with the kubelet's reasons, kept in memory per pod (the last
//! [`EVENTS_PER_POD`]) and served by the status API. Repeats of the same event are folded into
//! one with a count, as the API server's event correlator does.

use std::borrow::Cow;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use kubevol_core::{PodRef, PodUid};
use serde::{Deserialize, Serialize};

/// How many events are kept per pod.
pub const EVENTS_PER_POD: usize = 32;

/// The event reasons kubevol emits: the kubelet's, and `UnknownField` and `SELinuxUnavailable` of
/// its own.
pub mod reason {
    /// A volume was set up for a pod.
    pub const SUCCESSFUL_MOUNT_VOLUME: &str = "SuccessfulMountVolume";
    /// Set-up failed.
    pub const FAILED_MOUNT: &str = "FailedMount";
    /// Teardown failed.
    pub const FAILED_UNMOUNT: &str = "FailedUnMount";
    /// A volume was torn down for a pod.
    pub const SUCCESSFUL_UNMOUNT_VOLUME: &str = "SuccessfulUnMountVolume";
    /// The pod was rejected before anything was done.
    pub const FAILED_VALIDATION: &str = "FailedValidation";
    /// Another pod gave itself this pod's UID: it is refused.
    pub const UID_CONFLICT: &str = "UIDConflict";
    /// A field of a volume that kubevol's API types do not have: ignored.
    pub const UNKNOWN_FIELD: &str = "UnknownField";
    /// A volume was expanded on the node.
    pub const FILE_SYSTEM_RESIZE_SUCCESSFUL: &str = "FileSystemResizeSuccessful";
    /// The node's part of an expansion failed.
    pub const FILE_SYSTEM_RESIZE_FAILED: &str = "FileSystemResizeFailed";
    /// A pod asks for an SELinux label for a volume that would be mounted with it, but the node
    /// has no SELinux: mounted without the label.
    pub const SELINUX_UNAVAILABLE: &str = "SELinuxUnavailable";
    /// A provisioned volume cannot grow to its claim's new request.
    pub const VOLUME_RESIZE_FAILED: &str = "VolumeResizeFailed";
    /// A volume's fsGroup walk is taking long (the kubelet's reason).
    pub const VOLUME_PERMISSION_CHANGE_IN_PROGRESS: &str = "VolumePermissionChangeInProgress";
    /// The signer denied a pod certificate's request.
    pub const DENIED: &str = "Denied";
    /// The signer failed a pod certificate's request.
    pub const FAILED: &str = "Failed";
    /// A pod certificate is more than 10 minutes past its `beginRefreshAt` without a new one.
    pub const CERTIFICATE_OVERDUE_FOR_REFRESH: &str = "CertificateOverdueForRefresh";
    /// A pod certificate is past its `notAfter` without a new one.
    pub const CERTIFICATE_EXPIRED: &str = "CertificateExpired";
}

/// One event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// `namespace/name` of the pod.
    pub pod: String,
    /// The pod's UID.
    pub uid: PodUid,
    /// `Normal` or `Warning`.
    #[serde(rename = "type")]
    pub type_: Cow<'static, str>,
    /// The kubelet's reason.
    pub reason: Cow<'static, str>,
    /// What happened.
    pub message: String,
    /// How many times it happened.
    pub count: u32,
    /// When it first happened (seconds since the epoch).
    pub first_timestamp: u64,
    /// When it last happened (seconds since the epoch).
    pub last_timestamp: u64,
}

/// One event as it is handed to an outside sink (the API server in cluster mode).
#[derive(Clone, Debug)]
pub struct PodEvent {
    /// The pod.
    pub pod: PodRef,
    /// `Warning` rather than `Normal`.
    pub warning: bool,
    /// The reason.
    pub reason: &'static str,
    /// The message.
    pub message: String,
}

/// A pod's events: the last [`EVENTS_PER_POD`], and how often each distinct event came (by a
/// hash of its reason and message), however many there are: a repeat is logged at its 2nd,
/// 4th, 8th, ... time whether or not it is still among the last kept (a pod of 300 failing
/// volumes pushed each volume's failure out of the 32 kept before it came again, and every
/// repeat was logged).
#[derive(Default)]
struct PodEvents {
    kept: VecDeque<Event>,
    seen: kubevol_core::collections::HashMap<u64, u32>,
}

/// The most distinct events counted for one pod; past it the counts start again (a pod whose
/// messages never repeat, a changing count in each, would otherwise grow the map forever).
const COUNTED_PER_POD: usize = 4096;

fn event_hash(reason: &str, message: &str) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = foldhash::fast::FixedState::default().build_hasher();
    h.write(reason.as_bytes());
    h.write_u8(0);
    h.write(message.as_bytes());
    h.finish()
}

/// The recorder.
#[derive(Default)]
pub struct EventRecorder {
    per_pod: Mutex<BTreeMap<PodUid, PodEvents>>,
    /// Where events go besides memory; a full queue drops the event (the sink is behind).
    sink: std::sync::OnceLock<tokio::sync::mpsc::Sender<PodEvent>>,
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Logs an event: a warning as a warning, a normal event as information, but a volume's
/// successful set-up or teardown at debug: a node sets up thousands of volumes a second in a
/// storm, and the pod's own line says when all of its volumes are mounted or torn down.
fn log(pod: &PodRef, warning: bool, reason: &str, message: &str) {
    if warning {
        tracing::warn!(pod = %pod, reason, "{message}");
    } else if reason == self::reason::SUCCESSFUL_MOUNT_VOLUME
        || reason == self::reason::SUCCESSFUL_UNMOUNT_VOLUME
    {
        tracing::debug!(pod = %pod, reason, "{message}");
    } else {
        tracing::info!(pod = %pod, reason, "{message}");
    }
}

impl EventRecorder {
    /// Sends every warning to `sink` too (once; later calls are ignored).
    pub fn set_sink(&self, sink: tokio::sync::mpsc::Sender<PodEvent>) {
        let _ = self.sink.set(sink);
    }

    /// Records an event; `warning` selects the type. Only a warning goes to the sink: a
    /// volume's successful set-up (the one normal event) is kept here and logged, not posted,
    /// as the kubelet has done since Kubernetes 1.11 (kubernetes/kubernetes#63339): every pod
    /// has volumes, and a node of short-lived pods would fill the API server's events, and the
    /// sink's queue ahead of the failures, with them.
    pub fn record(&self, pod: &PodRef, warning: bool, reason: &'static str, message: String) {
        if let Some(sink) = self.sink.get().filter(|_| warning) {
            let _ = sink.try_send(PodEvent {
                pod: pod.clone(),
                warning,
                reason,
                message: message.clone(),
            });
        }
        let now = now_secs();
        let mut map = crate::sync::lock(&self.per_pod);
        let events = map.entry(pod.uid.clone()).or_default();
        if events.seen.len() >= COUNTED_PER_POD {
            events.seen.clear();
        }
        let count = {
            let n = events.seen.entry(event_hash(reason, &message)).or_default();
            *n = n.saturating_add(1);
            *n
        };
        // The same event again is logged at its 2nd, 4th, 8th, ... time, with the count: a
        // volume that keeps failing the same way (each failure a backoff step after the last)
        // fills no log.
        match count {
            1 => log(pod, warning, reason, &message),
            n if n.is_power_of_two() => log(
                pod,
                warning,
                reason,
                &format!("{message} (the same event {n} times)"),
            ),
            _ => {}
        }
        let q = &mut events.kept;
        if let Some(last) = q
            .iter_mut()
            .find(|e| e.reason == reason && e.message == message)
        {
            // Folded into the one kept.
            last.count = count;
            last.last_timestamp = now;
            return;
        }
        if q.len() == EVENTS_PER_POD {
            q.pop_front();
        }
        q.push_back(Event {
            pod: pod.to_string(),
            uid: pod.uid.clone(),
            type_: Cow::Borrowed(if warning { "Warning" } else { "Normal" }),
            reason: Cow::Borrowed(reason),
            message,
            count,
            first_timestamp: now,
            last_timestamp: now,
        });
    }

    /// A pod's events, oldest first.
    pub fn for_pod(&self, uid: &PodUid) -> Vec<Event> {
        let map = crate::sync::lock(&self.per_pod);
        map.get(uid)
            .map(|q| q.kept.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Every event, ordered by last occurrence.
    pub fn all(&self) -> Vec<Event> {
        let map = crate::sync::lock(&self.per_pod);
        let mut v: Vec<Event> = map.values().flat_map(|e| &e.kept).cloned().collect();
        v.sort_by_key(|e| e.last_timestamp);
        v
    }

    /// Forgets a pod's events (the pod is gone and torn down).
    pub fn forget(&self, uid: &PodUid) {
        crate::sync::lock(&self.per_pod).remove(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> PodRef {
        PodRef {
            namespace: "default".into(),
            name: "p".into(),
            uid: PodUid("u".into()),
        }
    }

    /// A log kept in memory.
    #[derive(Clone, Default)]
    struct Log(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Log {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_repeated_event_is_logged_at_its_2nd_4th_8th_time_with_its_count() {
        let r = EventRecorder::default();
        let pod = pod();
        let log = Log::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            for _ in 0..10 {
                r.record(&pod, true, reason::FAILED_MOUNT, "boom".into());
            }
            r.record(&pod, true, reason::FAILED_MOUNT, "another".into());
        });
        let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 5, "{text}");
        assert!(lines[0].contains("events: boom pod="), "{text}");
        for (line, n) in lines[1..4].iter().zip([2, 4, 8]) {
            assert!(
                line.contains(&format!("boom (the same event {n} times) pod=")),
                "{text}"
            );
        }
        assert!(
            lines[4].contains("another pod="),
            "another event is logged at once: {text}"
        );
        assert_eq!(r.for_pod(&pod.uid)[0].count, 10, "every one counted");
    }

    /// A pod of 300 volumes failing the same way again and again: each volume's failure is
    /// logged at its 1st, 2nd, 4th and 8th time (not at each), though only the last 32 events
    /// are kept; the count kept is the whole count.
    #[test]
    fn repeats_of_many_distinct_failures_are_folded_in_the_log() {
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || LogBuf(writer.clone()))
            .finish();
        let r = EventRecorder::default();
        let pod = pod();
        tracing::subscriber::with_default(subscriber, || {
            for _round in 0..10 {
                for v in 0..300 {
                    r.record(
                        &pod,
                        true,
                        reason::FAILED_MOUNT,
                        format!("volume v{v}: configMap c{v} not found"),
                    );
                }
            }
        });
        let text = String::from_utf8(log.lock().unwrap().clone()).unwrap();
        let lines = text.lines().count();
        // Rounds 1, 2, 4 and 8 of each volume.
        assert_eq!(
            lines,
            300 * 4,
            "{lines} lines for 3,000 failures of 300 volumes"
        );
        assert!(text.contains("volume v7: configMap c7 not found (the same event 8 times)"));
        let kept = r.for_pod(&pod.uid);
        assert_eq!(kept.len(), EVENTS_PER_POD);
        assert!(kept.iter().all(|e| e.count == 10), "{kept:?}");
    }

    /// A writer of log lines into a shared buffer.
    struct LogBuf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for LogBuf {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn repeats_fold_and_old_events_fall_off() {
        let r = EventRecorder::default();
        let pod = pod();
        r.record(&pod, true, reason::FAILED_MOUNT, "boom".into());
        r.record(&pod, true, reason::FAILED_MOUNT, "boom".into());
        let ev = r.for_pod(&pod.uid);
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].count, 2);
        assert_eq!(ev[0].type_, "Warning");
        for i in 0..EVENTS_PER_POD + 5 {
            r.record(
                &pod,
                false,
                reason::SUCCESSFUL_MOUNT_VOLUME,
                format!("m{i}"),
            );
        }
        assert_eq!(r.for_pod(&pod.uid).len(), EVENTS_PER_POD);
    }

    /// The sink gets the warnings; a successful set-up is kept in memory only.
    #[test]
    fn only_warnings_go_to_the_sink() {
        let r = EventRecorder::default();
        let (tx, mut rx) = tokio::sync::mpsc::channel(8);
        r.set_sink(tx);
        let pod = pod();
        r.record(&pod, false, reason::SUCCESSFUL_MOUNT_VOLUME, "ok".into());
        r.record(&pod, true, reason::FAILED_MOUNT, "boom".into());
        let sent = rx.try_recv().expect("the warning is sent");
        assert_eq!(
            (sent.reason, sent.message.as_str()),
            (reason::FAILED_MOUNT, "boom")
        );
        assert!(rx.try_recv().is_err(), "nothing else is sent");
        let kept: Vec<_> = r.for_pod(&pod.uid).into_iter().map(|e| e.reason).collect();
        assert_eq!(
            kept,
            [reason::SUCCESSFUL_MOUNT_VOLUME, reason::FAILED_MOUNT]
        );
    }
}
