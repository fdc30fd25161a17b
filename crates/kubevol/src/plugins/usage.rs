//! What each mounted emptyDir holds, for `/stats/summary` (the kubelet's Summary API, which
//! eviction and metrics-server read) and `describe`: measured when the summary is asked for and
//! the last measure is older than the volume-stats period, so that a node nobody asks costs
//! nothing (the kubelet measures every volume every period, asked or not).
//!
//! A disk-backed emptyDir made where the filesystem accounts project quotas (XFS `prjquota`,
//! ext4 `project` + `prjquota`) gets a project of its own when it is made (`Config::
//! project_quotas`, on by default): its usage is then one `quotactl`, whatever it holds, where
//! the kubelet (without its alpha `LocalStorageCapacityIsolationFSQuotaMonitoring`) walks every
//! volume every minute. Elsewhere the volume is walked, stating each entry once; a memory-backed
//! one is its own tmpfs, whose counters say it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use kubevol_core::PodUid;
use kubevol_mount::safe::Dir;
use kubevol_mount::usage::{self, FIRST_PROJECT};

use super::PluginHost;

/// How many project IDs a set-up tries before it leaves the volume without one (IDs that hold
/// something are another directory's: after a restart, the volumes still there).
const TRIES: u32 = 100_000;

/// The project IDs given to disk-backed emptyDir volumes.
pub struct Projects {
    enabled: bool,
    /// Whether the filesystem of the pods' directories accounts project quotas: asked at the
    /// first set-up of a disk-backed emptyDir.
    supported: OnceLock<bool>,
    /// The next ID to try.
    next: AtomicU32,
}

impl Projects {
    /// Projects given (`enabled`) where the filesystem accounts them, or never.
    pub fn new(enabled: bool) -> Self {
        Projects {
            enabled,
            supported: OnceLock::new(),
            next: AtomicU32::new(FIRST_PROJECT),
        }
    }

    /// Gives the volume directory `dir`, made empty just now, a project of its own when
    /// projects are given and accounted here; says which. A volume without one is walked.
    pub(crate) fn give(&self, dir: &Dir) -> Option<u32> {
        if !self.enabled || !*self.supported.get_or_init(|| usage::project_quotas(dir)) {
            return None;
        }
        for _ in 0..TRIES {
            let id = self
                .next
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    Some(n.checked_add(1).unwrap_or(FIRST_PROJECT))
                })
                .unwrap_or(FIRST_PROJECT);
            match usage::give_project(dir, id) {
                Ok(true) => return Some(id),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(path = %dir.path().display(), "cannot give the volume a project of its own; its usage is walked: {e}");
                    return None;
                }
            }
        }
        tracing::warn!(path = %dir.path().display(), "no free project ID among {TRIES} tried; the volume's usage is walked");
        None
    }
}

/// How a volume's usage was measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    /// The filesystem's project quota: one call.
    ProjectQuota,
    /// Every entry stated.
    Walk,
    /// The volume's own tmpfs or hugetlbfs: its counters.
    OwnFilesystem,
}

impl Measure {
    /// As `/stats/summary` names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Measure::ProjectQuota => "project-quota",
            Measure::Walk => "walk",
            Measure::OwnFilesystem => "own-filesystem",
        }
    }
}

impl serde::Serialize for Measure {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// What an emptyDir holds, and the filesystem it is on.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Used {
    /// Bytes of its blocks.
    pub used_bytes: u64,
    /// Its inodes.
    pub inodes_used: u64,
    /// The filesystem's size, bytes.
    pub capacity_bytes: u64,
    /// What the filesystem has free for its users, bytes.
    pub available_bytes: u64,
    /// The filesystem's inodes.
    pub inodes: u64,
    /// Its free inodes.
    pub inodes_free: u64,
    /// How `used_bytes` and `inodes_used` were found.
    #[serde(rename = "measuredBy")]
    pub by: Measure,
    /// When (RFC 3339).
    #[serde(rename = "time", serialize_with = "rfc3339")]
    pub at: Option<SystemTime>,
}

fn rfc3339<S: serde::Serializer>(at: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
    let at = at.and_then(|t| jiff::Timestamp::try_from(t).ok());
    s.collect_str(&at.map(|t| t.to_string()).unwrap_or_default())
}

/// The mounted emptyDir volumes of `world`: pod, volume name, path, and whether it is a
/// filesystem of its own.
fn mounted_empty_dirs(world: &crate::world::World) -> Vec<(PodUid, String, PathBuf, bool)> {
    let asw = world.asw();
    asw.volumes()
        .flat_map(|v| v.pods.values())
        .filter(|m| m.state == kubevol_core::state::PodMountState::Mounted)
        .filter(|m| m.spec.volume.empty_dir.is_some())
        .map(|m| {
            let own = !super::empty_dir::on_disk(&m.spec);
            let volume = m.outer_volume_name.to_string();
            (m.pod_ref.uid.clone(), volume, m.path.clone(), own)
        })
        .collect()
}

/// Measures every mounted emptyDir of `world`, unless the last measure is younger than
/// `max_age` (one measure at a time: a second caller waits and takes the first's).
pub(crate) fn refresh(host: &PluginHost, world: &crate::world::World, max_age: Duration) {
    let mut last = crate::sync::lock(&host.usages.measured);
    if last.is_some_and(|t| t.elapsed() < max_age) {
        return;
    }
    measure_all(host, &mounted_empty_dirs(world));
    *last = Some(Instant::now());
}

/// Measures every emptyDir of `mounted` (pod, volume name, path, whether a filesystem of its
/// own) and keeps the measures in place of the last ones.
fn measure_all(host: &PluginHost, mounted: &[(PodUid, String, PathBuf, bool)]) {
    let mut now = BTreeMap::new();
    for (pod, volume, path, own) in mounted {
        match measure(host, path, *own) {
            Ok(used) => {
                now.insert((pod.clone(), volume.clone()), used);
            }
            Err(e) => tracing::debug!(pod = %pod, volume = %volume, "emptyDir usage: {e}"),
        }
    }
    host.usages.set_all(now);
}

/// Measures the emptyDir at `path` (a path below the root directory, reached beneath it), a
/// filesystem of its own when `own_filesystem` (a tmpfs or hugetlbfs medium).
pub(crate) fn measure(
    host: &PluginHost,
    path: &Path,
    own_filesystem: bool,
) -> Result<Used, kubevol_mount::MountError> {
    let below = path.strip_prefix(&host.root).unwrap_or(path);
    let dir = host.root_dir.open_beneath(below)?;
    let fs = rustix::fs::fstatvfs(dir.fd()).map_err(|errno| kubevol_mount::MountError::Io {
        op: "statfs",
        path: path.to_path_buf(),
        errno,
    })?;
    let block = fs.f_frsize;
    let (used, by) = if own_filesystem {
        let used = usage::Usage {
            bytes: fs.f_blocks.saturating_sub(fs.f_bfree) * block,
            inodes: fs.f_files.saturating_sub(fs.f_ffree),
        };
        (used, Measure::OwnFilesystem)
    } else {
        // (A project no longer accounted, the filesystem mounted without quotas since: walked.)
        // (A filesystem without the attributes has no project.)
        let quota = usage::project(&dir)
            .ok()
            .flatten()
            .and_then(|id| usage::project_usage(&dir, id).ok());
        match quota {
            Some(used) => (used, Measure::ProjectQuota),
            None => (usage::walk_usage(&dir)?, Measure::Walk),
        }
    };
    Ok(Used {
        used_bytes: used.bytes,
        inodes_used: used.inodes,
        capacity_bytes: fs.f_blocks * block,
        available_bytes: fs.f_bavail * block,
        inodes: fs.f_files,
        inodes_free: fs.f_ffree,
        by,
        at: Some(SystemTime::now()),
    })
}

/// The last measure of every mounted emptyDir, by pod and volume name.
#[derive(Default)]
pub struct Usages {
    by_volume: Mutex<BTreeMap<(PodUid, String), Used>>,
    /// When every volume was last measured; held while they are.
    measured: Mutex<Option<Instant>>,
}

impl Usages {
    /// Replaces every measure with `now` (volumes not in it are gone).
    pub(crate) fn set_all(&self, now: BTreeMap<(PodUid, String), Used>) {
        *crate::sync::lock(&self.by_volume) = now;
    }

    /// The last measure of `volume` of `pod`.
    pub fn get(&self, pod: &PodUid, volume: &str) -> Option<Used> {
        crate::sync::lock(&self.by_volume)
            .get(&(pod.clone(), volume.to_string()))
            .cloned()
    }

    /// Every measure.
    pub fn all(&self) -> BTreeMap<(PodUid, String), Used> {
        crate::sync::lock(&self.by_volume).clone()
    }
}
