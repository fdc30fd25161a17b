//! A pod's fsGroup given to a volume's data (emptyDir, local, CSI volumes kubevol applies it
//! to), watched as the kubelet watches its SetVolumeOwnership: a walk that has run longer than
//! [`WARN_AFTER`] posts the kubelet's warning event `VolumePermissionChangeInProgress` (naming
//! `OnRootMismatch`), then one every [`REPORT_EVERY`] with the entries done; meanwhile
//! `describe` shows how far it has got.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kubevol_core::{PodRef, PodUid};
use kubevol_mount::safe::{Dir, FsGroupPolicy};
use kubevol_mount::MountError;

use super::PluginHost;

/// How long a walk runs before its pod is warned (the kubelet's 30 s).
pub const WARN_AFTER: Duration = Duration::from_secs(30);

/// How often a long walk reports its progress after the warning (the kubelet's 60 s).
pub const REPORT_EVERY: Duration = Duration::from_secs(60);

/// The walks under way, by pod and volume name.
pub struct Walks {
    running: Mutex<BTreeMap<(PodUid, String), Progress>>,
    /// [`WARN_AFTER`], or a test's.
    warn_after: Duration,
}

/// How far one walk has got.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    /// When it began.
    pub started: Instant,
    /// Entries looked at so far.
    pub entries: u64,
    /// The group.
    pub gid: u32,
    /// When its pod was last told (`None`: not yet).
    told: Option<Instant>,
}

impl Walks {
    /// Walks that warn after `warn_after` ([`WARN_AFTER`] as the kubelet).
    pub fn warning_after(warn_after: Duration) -> Walks {
        Walks {
            running: Mutex::default(),
            warn_after,
        }
    }

    /// How far the walk of the pod's volume `volume` has got, while one runs.
    pub fn progress(&self, pod: &PodUid, volume: &str) -> Option<Progress> {
        crate::sync::lock(&self.running)
            .get(&(pod.clone(), volume.to_string()))
            .copied()
    }
}

/// The message of a long walk's event: the kubelet's words, the volume named from the pod's
/// UID on (as the kubelet names it).
fn message(progress: &Progress, first: bool, volume_dir: &str) -> String {
    if first {
        format!(
            "Setting volume ownership for {volume_dir} is taking longer than expected, consider using OnRootMismatch - https://kubernetes.io/docs/tasks/configure-pod-container/security-context/#configure-volume-permission-and-ownership-change-policy-for-pods"
        )
    } else {
        format!(
            "Setting volume ownership for {volume_dir}, processed {} files.",
            progress.entries
        )
    }
}

impl PluginHost {
    /// Gives `dir`, the pod's volume `volume` (its name in the pod's spec), the pod's group
    /// `gid` as [`Dir::apply_fs_group`] does, watched (see the module). Returns whether it
    /// walked.
    pub(crate) fn apply_fs_group(
        &self,
        pod: &PodRef,
        volume: &str,
        dir: &Dir,
        gid: u32,
        policy: FsGroupPolicy,
    ) -> Result<bool, MountError> {
        let walks = &self.ownership;
        let key = (pod.uid.clone(), volume.to_string());
        let started = Instant::now();
        let warn_after = walks.warn_after;
        // Named from the pod's UID on, as the kubelet names it.
        let path = dir.path().display().to_string();
        let volume_dir = match path.find(pod.uid.as_str()) {
            Some(at) => path[at..].to_string(),
            None => path,
        };
        let progress = |entries: u64| {
            let tell = {
                let mut running = crate::sync::lock(&walks.running);
                let p = running.entry(key.clone()).or_insert(Progress {
                    started,
                    entries: 0,
                    gid,
                    told: None,
                });
                p.entries = p.entries.max(entries);
                let due = match p.told {
                    None => started.elapsed() >= warn_after,
                    Some(at) => at.elapsed() >= REPORT_EVERY,
                };
                let first = p.told.is_none();
                due.then(|| {
                    p.told = Some(Instant::now());
                    message(p, first, &volume_dir)
                })
            };
            if let Some(m) = tell {
                tracing::warn!(pod = %pod, volume, "{m}");
                self.events.record(
                    pod,
                    true,
                    crate::events::reason::VOLUME_PERMISSION_CHANGE_IN_PROGRESS,
                    m,
                );
            }
        };
        let walked = dir.apply_fs_group_reporting(gid, false, policy, &progress);
        crate::sync::lock(&walks.running).remove(&key);
        walked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_messages_are_the_kubelets() {
        let p = Progress {
            started: Instant::now(),
            entries: 123_456,
            gid: 2000,
            told: None,
        };
        let dir = "0f0e-uid/volumes/kubernetes.io~empty-dir/data";
        assert!(message(&p, true, dir).starts_with(
            "Setting volume ownership for 0f0e-uid/volumes/kubernetes.io~empty-dir/data is taking longer than expected, consider using OnRootMismatch"
        ));
        assert_eq!(
            message(&p, false, dir),
            "Setting volume ownership for 0f0e-uid/volumes/kubernetes.io~empty-dir/data, processed 123456 files."
        );
    }
}
