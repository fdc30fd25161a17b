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
use std::time::{Duration, SystemTime};

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

/// How long a `/stats/summary` request waits for the measurements it started or found under
/// way; a volume still being measured then is reported with its last measure (its `time`
/// says how old), or not at all.
pub const STATS_WAIT: Duration = Duration::from_secs(5);

/// The most threads that measure volumes at once. They are kubevol's own, apart from the
/// runtime's blocking pool that set-ups and teardowns use, so that a slow measurement (a tree a
/// pod made deep) never takes a thread that mounting needs.
const MEASURERS: usize = 4;

/// Measures every mounted emptyDir of `world` whose last measure is older than `max_age` and
/// is not being measured already, and waits (at most [`STATS_WAIT`]) for the measurements under
/// way. Each volume is measured by one thread at a time, whoever asks and however often;
/// a caller that stops waiting (a request cancelled) stops nothing but its wait.
pub(crate) async fn refresh(
    host: &std::sync::Arc<PluginHost>,
    world: &crate::world::World,
    max_age: Duration,
) {
    let mounted = mounted_empty_dirs(world);
    let mut changed = host.usages.changed.subscribe();
    let awaited = host.usages.ask(host, mounted, max_age);
    let deadline = tokio::time::Instant::now() + STATS_WAIT;
    while host.usages.any_measuring(&awaited) {
        if tokio::time::timeout_at(deadline, changed.changed())
            .await
            .is_err()
        {
            return;
        }
    }
}

/// One volume's measures.
struct Slot {
    path: PathBuf,
    own_filesystem: bool,
    last: Option<Used>,
    /// Being measured (or waiting for a thread to measure it).
    measuring: bool,
}

/// The volumes' measures and the measurements to make.
#[derive(Default)]
struct Meter {
    by_volume: BTreeMap<(PodUid, String), Slot>,
    queue: std::collections::VecDeque<(PodUid, String)>,
    /// Threads measuring now.
    threads: usize,
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

/// The last measure of every mounted emptyDir, by pod and volume name, and the measurements
/// under way.
#[derive(Default)]
pub struct Usages {
    meter: Mutex<Meter>,
    /// Bumped when a measurement ends.
    changed: tokio::sync::watch::Sender<u64>,
}

impl Usages {
    /// Queues a measurement of each of `mounted` (pod, volume name, path, whether a filesystem
    /// of its own) whose last measure is older than `max_age`, unless one is under way, and
    /// starts threads for them; forgets the volumes no longer mounted. Returns the volumes
    /// being measured.
    fn ask(
        &self,
        host: &std::sync::Arc<PluginHost>,
        mounted: Vec<(PodUid, String, PathBuf, bool)>,
        max_age: Duration,
    ) -> Vec<(PodUid, String)> {
        let mut meter = crate::sync::lock(&self.meter);
        let mut now = BTreeMap::new();
        let mut awaited = Vec::new();
        for (pod, volume, path, own_filesystem) in mounted {
            let key = (pod, volume);
            let mut slot = meter.by_volume.remove(&key).unwrap_or(Slot {
                path: path.clone(),
                own_filesystem,
                last: None,
                measuring: false,
            });
            let fresh = slot.last.as_ref().is_some_and(|u| {
                u.at.and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age < max_age)
            });
            if !slot.measuring && !fresh {
                slot.measuring = true;
                slot.path = path;
                slot.own_filesystem = own_filesystem;
                meter.queue.push_back(key.clone());
            }
            if slot.measuring {
                awaited.push(key.clone());
            }
            now.insert(key, slot);
        }
        // A volume no longer mounted whose measurement is under way is forgotten too: its
        // thread finds no slot for what it measured.
        meter
            .queue
            .retain(|k| now.get(k).is_some_and(|s: &Slot| s.measuring));
        meter.by_volume = now;
        // Every thread is busy with one volume (or about to take the next queued): one more
        // for each queued volume, up to the limit.
        let mut started_now = 0;
        while meter.threads < MEASURERS && started_now < meter.queue.len() {
            let host = host.clone();
            let started = std::thread::Builder::new()
                .name("kubevol-usage".into())
                .spawn(move || measure_queued(&host));
            match started {
                Ok(_) => {
                    meter.threads += 1;
                    started_now += 1;
                }
                Err(e) => {
                    tracing::warn!("cannot start a thread to measure emptyDir usage: {e}");
                    break;
                }
            }
        }
        if meter.threads == 0 {
            // No thread: nothing will be measured now (the next request tries again).
            for key in std::mem::take(&mut meter.queue) {
                if let Some(s) = meter.by_volume.get_mut(&key) {
                    s.measuring = false;
                }
            }
            return Vec::new();
        }
        awaited
    }

    /// Whether any of `keys` is still being measured.
    fn any_measuring(&self, keys: &[(PodUid, String)]) -> bool {
        let meter = crate::sync::lock(&self.meter);
        keys.iter()
            .any(|k| meter.by_volume.get(k).is_some_and(|s| s.measuring))
    }

    /// How many volumes are being measured or wait for a thread, and how many threads measure.
    pub fn measuring(&self) -> (usize, usize) {
        let meter = crate::sync::lock(&self.meter);
        let volumes = meter.by_volume.values().filter(|s| s.measuring).count();
        (volumes, meter.threads)
    }

    /// The last measure of `volume` of `pod`.
    pub fn get(&self, pod: &PodUid, volume: &str) -> Option<Used> {
        crate::sync::lock(&self.meter)
            .by_volume
            .get(&(pod.clone(), volume.to_string()))
            .and_then(|s| s.last.clone())
    }

    /// Every measure.
    pub fn all(&self) -> BTreeMap<(PodUid, String), Used> {
        crate::sync::lock(&self.meter)
            .by_volume
            .iter()
            .filter_map(|(k, s)| Some((k.clone(), s.last.clone()?)))
            .collect()
    }
}

/// A measuring thread: measures the queued volumes one after another, and ends when none is
/// left.
fn measure_queued(host: &PluginHost) {
    let usages = &host.usages;
    loop {
        let (key, path, own) = {
            let mut meter = crate::sync::lock(&usages.meter);
            let next = loop {
                let Some(key) = meter.queue.pop_front() else {
                    break None;
                };
                if let Some(s) = meter.by_volume.get(&key) {
                    break Some((s.path.clone(), s.own_filesystem, key));
                }
            };
            match next {
                Some((path, own, key)) => (key, path, own),
                None => {
                    meter.threads -= 1;
                    return;
                }
            }
        };
        let result = measure(host, &path, own);
        {
            let mut meter = crate::sync::lock(&usages.meter);
            if let Some(slot) = meter.by_volume.get_mut(&key) {
                slot.measuring = false;
                match result {
                    Ok(used) => slot.last = Some(used),
                    Err(e) => {
                        tracing::debug!(pod = %key.0, volume = %key.1, "emptyDir usage: {e}")
                    }
                }
            }
        }
        usages.changed.send_modify(|n| *n += 1);
    }
}
