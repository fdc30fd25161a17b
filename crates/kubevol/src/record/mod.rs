//! The durable record: what kubevol intends to do and has done on the node, kept under
//! `<root>/volume-record/` so that a crash at any instant leaves evidence for reconstruction.
//!
//! ```text
//! <root>/volume-record/journal     one JSON line per record written or removed
//! ```
//!
//! Each pod volume and each node-wide volume (attach, CSI stage) has a small, versioned JSON
//! record; the journal's latest line for a volume is its record (see `journal.rs` for the
//! format, its compaction and how a torn or corrupt line is read). Before a side effect the
//! intent is appended and the journal fsync'd. After the side effect a line says what the
//! actual state now holds (or removes the record when nothing is left); that line needs no
//! fsync, because losing it only brings back the intent, and an intent means "uncertain",
//! which reconstruction handles the same way.
//!
//! Operations hand their changes to one writer thread ([`Record::commit`]), which appends all
//! changes queued at that moment as one batch: a storm of set-ups pays one write and one
//! fsync per batch, not a file per volume, and no operation blocks a runtime thread on the
//! disk.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use k8s_openapi::api::core::v1::{PersistentVolume, Volume};
use kubevol_core::state::{
    ActualVolume, DeviceMountState, MountedPodVolume, PodVolumeRef, SubPathMount, VolumeSpec,
    VolumeTraits,
};
use kubevol_core::{PodRef, PodUid, UniqueVolumeName};
use serde::{Deserialize, Serialize};

mod encode;
mod fail;
mod journal;
mod owner;
mod writer;

pub use fail::{fail_point, FAIL_POINTS, FAIL_POINT_ENV};
pub use journal::JOURNAL;
use journal::{Appender, Lines, Live, Place};
pub use owner::{DirLock, RootLock, LOCAL_PATH_LOCK_FILE, LOCK_FILE};
pub(crate) use writer::copy_error;
use writer::Job;
pub use writer::{Answers, Change, Committed};

/// The record's directory under the root.
pub const RECORD_DIR: &str = "volume-record";

/// The record format's version.
pub const VERSION: u32 = 1;

/// Where a pod volume stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum PodVolumeState {
    /// Set-up was about to start (or ran and was interrupted).
    SettingUp,
    /// Set-up succeeded.
    SetUp,
    /// Set-up or teardown failed in a way that may have left something on the node.
    Uncertain,
    /// Teardown was about to start (or ran and was interrupted).
    TearingDown,
}

/// A node-wide step's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum DeviceStepState {
    /// About to start, or interrupted.
    Starting,
    /// Done.
    Done,
    /// Failed in a way that may have done it.
    Uncertain,
    /// Its inverse was about to start, or was interrupted.
    Undoing,
}

/// A volume's spec as recorded (the pod's volume, and the PV a claim resolved to). It holds
/// the spec's own shared parts, not copies: a record is made for every intent and outcome, and
/// a `Volume` is kilobytes.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpecRecord {
    /// The pod's `spec.volumes[]` entry.
    #[serde(serialize_with = "ser_volume", deserialize_with = "de_volume")]
    pub volume: PodVolumeRef,
    /// The PersistentVolume.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "ser_pv",
        deserialize_with = "de_pv"
    )]
    pub persistent_volume: Option<Arc<PersistentVolume>>,
    /// A raw block volume.
    #[serde(default)]
    pub block: bool,
    /// The SELinux label of the containers that use it, kept so that a restart knows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selinux: Option<Box<SelinuxRecord>>,
}

/// A volume's SELinux label as recorded.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SelinuxRecord {
    /// The label.
    pub label: String,
    /// Whether the volume is mounted with `-o context=` the label.
    #[serde(default)]
    pub mount: bool,
}

fn ser_volume<S: serde::Serializer>(v: &PodVolumeRef, s: S) -> Result<S::Ok, S::Error> {
    Volume::serialize(v, s)
}

fn de_volume<'de, D: serde::Deserializer<'de>>(d: D) -> Result<PodVolumeRef, D::Error> {
    Volume::deserialize(d).map(PodVolumeRef::from)
}

fn ser_pv<S: serde::Serializer>(
    pv: &Option<Arc<PersistentVolume>>,
    s: S,
) -> Result<S::Ok, S::Error> {
    pv.as_deref().serialize(s)
}

fn de_pv<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Arc<PersistentVolume>>, D::Error> {
    Ok(Option::<PersistentVolume>::deserialize(d)?.map(Arc::new))
}

impl SpecRecord {
    /// The record of a spec.
    pub fn of(spec: &VolumeSpec) -> Self {
        SpecRecord {
            volume: spec.volume.clone(),
            persistent_volume: spec.persistent_volume.clone(),
            block: spec.block,
            selinux: spec.selinux_label.as_ref().map(|label| {
                Box::new(SelinuxRecord {
                    label: label.clone(),
                    mount: spec.selinux_mount,
                })
            }),
        }
    }

    /// The spec it records.
    pub fn spec(&self) -> VolumeSpec {
        VolumeSpec {
            volume: self.volume.clone(),
            persistent_volume: self.persistent_volume.clone(),
            block: self.block,
            extensions: Default::default(),
            selinux_label: self.selinux.as_ref().map(|s| s.label.clone()),
            selinux_mount: self.selinux.as_ref().is_some_and(|s| s.mount),
        }
    }
}

/// The plugin facts of a volume.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TraitsRecord {
    /// The plugin.
    pub plugin: kubevol_core::names::SharedStr,
    /// Attachable.
    #[serde(default)]
    pub attachable: bool,
    /// Device-mountable.
    #[serde(default)]
    pub device_mountable: bool,
}

impl TraitsRecord {
    /// The record of a volume's traits.
    pub fn of(t: &VolumeTraits) -> Self {
        TraitsRecord {
            plugin: t.plugin.clone(),
            attachable: t.attachable,
            device_mountable: t.device_mountable,
        }
    }

    /// The traits it records.
    pub fn traits(&self) -> VolumeTraits {
        VolumeTraits {
            plugin: self.plugin.clone(),
            attachable: self.attachable,
            device_mountable: self.device_mountable,
        }
    }
}

/// One pod's volume.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodVolumeRecord {
    /// The format version.
    pub version: u32,
    /// Where it stands.
    pub state: PodVolumeState,
    /// The pod.
    pub pod: PodRef,
    /// Where the pod came from (manifest file and document), for messages.
    #[serde(default)]
    pub source: kubevol_core::names::SharedStr,
    /// The volume's name in the pod's spec.
    pub volume: kubevol_core::names::SharedStr,
    /// The volume's key in the states of world.
    pub unique_name: UniqueVolumeName,
    /// Its plugin's facts.
    pub traits: TraitsRecord,
    /// The path handed to the runtime.
    pub path: PathBuf,
    /// Whether the runtime mounts it read-only.
    #[serde(default)]
    pub read_only: bool,
    /// The subPath mounts made for it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sub_paths: Vec<SubPathMount>,
    /// The spec it was set up with.
    pub spec: SpecRecord,
}

impl PodVolumeRecord {
    /// The record of one pod's use of a volume, in `state`.
    pub fn of(
        state: PodVolumeState,
        unique_name: &UniqueVolumeName,
        traits: &VolumeTraits,
        m: &MountedPodVolume,
        source: kubevol_core::names::SharedStr,
    ) -> Self {
        PodVolumeRecord {
            version: VERSION,
            state,
            pod: m.pod_ref.clone(),
            source,
            volume: m.outer_volume_name.clone(),
            unique_name: unique_name.clone(),
            traits: TraitsRecord::of(traits),
            path: m.path.clone(),
            read_only: m.read_only,
            sub_paths: m.sub_paths.clone(),
            spec: SpecRecord::of(&m.spec),
        }
    }
}

/// One volume's node-wide state (attach, device mount).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceRecord {
    /// The format version.
    pub version: u32,
    /// The volume's key.
    pub unique_name: UniqueVolumeName,
    /// Its plugin's facts.
    pub traits: TraitsRecord,
    /// Attach, if it was ever started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attach: Option<DeviceStepState>,
    /// Device mount (CSI stage), if it was ever started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_mount: Option<DeviceStepState>,
    /// Where the device is mounted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_mount_path: Option<PathBuf>,
    /// What attach returned.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub publish_context: BTreeMap<String, String>,
    /// The size the volume was last expanded to, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expanded_size: Option<i64>,
    /// The spec it was set up with.
    pub spec: SpecRecord,
}

impl DeviceRecord {
    /// The record of what the actual state holds of a volume node-wide; `None` when nothing
    /// (no attach, no device mount) is left, or no spec is known.
    pub fn of(v: &ActualVolume) -> Option<Self> {
        use DeviceStepState as S;
        let attach = match (v.traits.attachable, v.attached, v.attach_uncertain) {
            (false, _, _) => None,
            (true, true, _) => Some(S::Done),
            (true, false, true) => Some(S::Uncertain),
            (true, false, false) => None,
        };
        let device_mount = match v.device_state {
            DeviceMountState::Mounted => Some(S::Done),
            DeviceMountState::Uncertain => Some(S::Uncertain),
            DeviceMountState::NotMounted => None,
        };
        if attach.is_none() && device_mount.is_none() {
            return None;
        }
        Some(DeviceRecord {
            version: VERSION,
            unique_name: v.name.clone(),
            traits: TraitsRecord::of(&v.traits),
            attach,
            device_mount,
            device_mount_path: v.device_mount_path.clone(),
            publish_context: v.publish_context.clone(),
            expanded_size: None,
            spec: SpecRecord::of(v.spec.as_deref()?),
        })
    }
}

/// A record that could not be read, and what its file name says.
#[derive(Clone, Debug)]
pub struct CorruptRecord {
    /// The file: the journal, or a record file of the earlier layout.
    pub path: PathBuf,
    /// The journal's line.
    pub line: Option<usize>,
    /// The pod it was about, when that can still be told.
    pub pod: Option<PodUid>,
    /// The volume's name in the pod's spec (record files of the earlier layout).
    pub volume: Option<String>,
    /// What is wrong with it.
    pub error: String,
}

impl std::fmt::Display for CorruptRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "record {}", self.path.display())?;
        if let Some(line) = self.line {
            write!(f, ", line {line},")?;
        }
        if let (Some(pod), Some(volume)) = (&self.pod, &self.volume) {
            write!(f, " (volume {volume:?} of pod {pod})")?;
        }
        write!(
            f,
            " cannot be read ({}); its volume is treated as possibly mounted and reconstructed from the pods directory and the mount table. ",
            self.error
        )?;
        match self.line {
            Some(_) => write!(
                f,
                "The line is dropped from the journal; the journal as it was is kept as {}",
                self.path.with_file_name("journal.corrupt").display()
            ),
            None => write!(f, "Remove the file by hand once nothing of it is mounted"),
        }
    }
}

/// Everything the record holds.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Pod volumes.
    pub pods: Vec<PodVolumeRecord>,
    /// Node-wide volumes.
    pub devices: Vec<DeviceRecord>,
    /// Records that could not be read.
    pub corrupt: Vec<CorruptRecord>,
}

/// The record under one root directory.
pub struct Record {
    dir: PathBuf,
    /// Where each volume's latest record lies in the journal (shared with the writer thread,
    /// which never holds the record itself: the record's last owner always ends and joins it).
    live: Arc<Mutex<Live>>,
    /// What could not be read at open.
    corrupt: Vec<CorruptRecord>,
    /// The journal's open end, until the writer thread takes it.
    appender: Mutex<Option<Appender>>,
    /// The writer thread, started by the first change queued.
    writer: OnceLock<Writer>,
}

/// The writer thread and the sending end of its queue.
struct Writer {
    queue: Mutex<std::sync::mpsc::Sender<Job>>,
    /// None when the thread could not be started (every change then fails).
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Record {
    /// Ends the writer thread and waits for it: once the record is gone nothing of it is open
    /// under the root, which can then be unmounted.
    fn drop(&mut self) {
        if let Some(Writer { queue, thread }) = self.writer.take() {
            drop(queue);
            if let Some(t) = thread {
                let _ = t.join();
            }
        }
    }
}

impl Record {
    /// Opens the record under `root` (made if missing) and reads it. A journal left with a
    /// torn or corrupt line, or with many dead lines, is compacted; records of the earlier
    /// layout are moved into the journal. Only one `Record` may write a root at a time.
    pub fn open(root: &Path) -> std::io::Result<Self> {
        let dir = root.join(RECORD_DIR);
        std::fs::create_dir_all(&dir)?;
        journal::remove_partial(&dir);
        let legacy = read_legacy(&dir, true);
        let read = journal::read(&dir.join(JOURNAL), legacy.live)?;
        let (appender, live) = if read.needs_compaction || !legacy.files.is_empty() {
            let mut entries: Vec<(&journal::Key, &Arc<[u8]>)> = read.live.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            let compacted = journal::compact(
                &dir,
                entries.into_iter().map(|(k, v)| Ok((k.clone(), v))),
                !read.corrupt.is_empty(),
            )?;
            if !legacy.files.is_empty() {
                tracing::info!(
                    records = legacy.files.len(),
                    "record files of the earlier layout moved into the journal"
                );
            }
            for f in &legacy.files {
                let _ = std::fs::remove_file(f);
            }
            for pod_dir in read_dir(&dir.join("pods")) {
                let _ = std::fs::remove_dir(pod_dir);
            }
            let _ = std::fs::remove_dir(dir.join("pods"));
            let _ = std::fs::remove_dir(dir.join("volumes"));
            (
                compacted.append,
                Live::new(compacted.places, compacted.read),
            )
        } else {
            // Every live line was read from the journal as it is.
            let places = read
                .live
                .iter()
                .filter_map(|(k, line)| Some((k.clone(), Place::of(*read.at.get(k)?, line))))
                .collect();
            let appender = Appender::open(&dir, read.lines)?;
            let journal = std::fs::File::open(dir.join(JOURNAL))?;
            (appender, Live::new(places, journal))
        };
        let mut corrupt = legacy.corrupt;
        corrupt.extend(read.corrupt);
        Ok(Record {
            dir,
            live: Arc::new(Mutex::new(live)),
            corrupt,
            appender: Mutex::new(Some(appender)),
            writer: OnceLock::new(),
        })
    }

    /// Reads the record under `root` without changing anything on disk (for tools and
    /// tests; a running kubevol keeps writing it).
    pub fn read(root: &Path) -> std::io::Result<Loaded> {
        let dir = root.join(RECORD_DIR);
        let legacy = read_legacy(&dir, false);
        let read = journal::read(&dir.join(JOURNAL), legacy.live)?;
        let mut corrupt = legacy.corrupt;
        corrupt.extend(read.corrupt);
        Ok(loaded(read.live.values().map(|l| &l[..]), corrupt))
    }

    /// The record's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The journal's path.
    pub fn journal(&self) -> PathBuf {
        self.dir.join(JOURNAL)
    }

    /// Records durably the size a volume was expanded to, in its node-wide record (volumes
    /// without one, which are never staged or attached, are expanded again after a restart,
    /// which drivers treat as a no-op).
    pub async fn set_expanded_size(
        self: &Arc<Self>,
        unique: &UniqueVolumeName,
        size: i64,
    ) -> std::io::Result<()> {
        match self.device(unique) {
            Some(mut d) if d.expanded_size != Some(size) => {
                d.expanded_size = Some(size);
                self.commit(Change::Device(d), true).await
            }
            _ => Ok(()),
        }
    }

    /// The last node-wide record written for a volume, if it is still there.
    pub fn device(&self, unique: &UniqueVolumeName) -> Option<DeviceRecord> {
        let (place, file) = {
            let live = crate::sync::lock(&self.live);
            (
                live.place(&journal::Key::Device(unique.clone()))?,
                live.file(),
            )
        };
        let line = place
            .read(&file)
            .inspect_err(|e| tracing::warn!(dir = %self.dir.display(), "cannot read the record of {unique}: {e}"))
            .ok()?;
        match journal::parse(&line) {
            Ok(journal::Line::Device(d)) => Some(d),
            _ => None,
        }
    }

    /// Every record, as read at open and written since. Unreadable ones found at open are
    /// returned as [`CorruptRecord`]s.
    pub fn load(&self) -> Loaded {
        let lines = crate::sync::lock(&self.live).lines();
        match lines {
            Ok(lines) => loaded(lines.iter().map(|l| &l[..]), self.corrupt.clone()),
            Err(e) => {
                let mut corrupt = self.corrupt.clone();
                corrupt.push(CorruptRecord {
                    path: self.journal(),
                    line: None,
                    pod: None,
                    volume: None,
                    error: format!("cannot read the journal: {e}"),
                });
                loaded(std::iter::empty(), corrupt)
            }
        }
    }
}

/// The records of `live`, sorted by pod and volume.
fn loaded<'a>(live: impl Iterator<Item = &'a [u8]>, corrupt: Vec<CorruptRecord>) -> Loaded {
    let mut out = Loaded {
        corrupt,
        ..Loaded::default()
    };
    for line in live {
        match journal::parse(line) {
            Ok(journal::Line::PodVolume(r)) => out.pods.push(r),
            Ok(journal::Line::Device(d)) => out.devices.push(d),
            // Only records are live, and they were parsed or written by this kubevol.
            Ok(_) | Err(_) => {}
        }
    }
    out.pods
        .sort_by(|a, b| (&a.pod.uid, &a.volume).cmp(&(&b.pod.uid, &b.volume)));
    out.devices
        .sort_by(|a, b| a.unique_name.cmp(&b.unique_name));
    out
}

/// The records of the earlier layout (a JSON file per volume).
struct Legacy {
    live: Lines,
    corrupt: Vec<CorruptRecord>,
    /// The files read.
    files: Vec<PathBuf>,
}

/// Reads the records of the earlier layout under `dir` (`pods/<uid>/<volume>.<hash>.json`,
/// `volumes/<hash>.json`); with `tidy`, removes their interrupted writes (`*.tmp`), whose side
/// effect never started.
fn read_legacy(dir: &Path, tidy: bool) -> Legacy {
    let mut out = Legacy {
        live: Lines::default(),
        corrupt: Vec::new(),
        files: Vec::new(),
    };
    let corrupt = |path: &Path, pod: Option<PodUid>, error: journal::FormatError| {
        let volume = pod.as_ref().and_then(|_| {
            let name = path.file_name()?.to_str()?;
            Some(name.split('.').next()?.to_string())
        });
        CorruptRecord {
            path: path.to_path_buf(),
            line: None,
            pod,
            volume,
            error: error.to_string(),
        }
    };
    let is_record = |p: &Path| p.extension().is_some_and(|e| e == "json");
    let pod_dirs = read_dir(&dir.join("pods"));
    if tidy {
        for d in pod_dirs.iter().chain([&dir.join("volumes")]) {
            for p in read_dir(d) {
                if p.extension().is_some_and(|e| e == "tmp") {
                    let _ = std::fs::remove_file(&p);
                }
            }
        }
    }
    for pod_dir in pod_dirs {
        let Some(uid) = pod_dir.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let uid = PodUid::from(uid);
        for file in read_dir(&pod_dir).into_iter().filter(|p| is_record(p)) {
            let line = read_json::<PodVolumeRecord>(&file).and_then(|r| {
                if r.pod.uid != uid {
                    return Err(journal::FormatError::Misplaced {
                        about: r.pod.uid.clone(),
                        dir: uid.clone(),
                    });
                }
                let line = journal::LineRef::PodVolume(&r).encode()?;
                Ok((
                    journal::Key::Pod(r.pod.uid.clone(), r.unique_name.clone()),
                    line,
                ))
            });
            match line {
                Ok((key, line)) => {
                    out.live.insert(key, line);
                    out.files.push(file);
                }
                Err(e) => out.corrupt.push(corrupt(&file, Some(uid.clone()), e)),
            }
        }
    }
    for file in read_dir(&dir.join("volumes"))
        .into_iter()
        .filter(|p| is_record(p))
    {
        let line = read_json::<DeviceRecord>(&file).and_then(|d| {
            let line = journal::LineRef::Device(&d).encode()?;
            Ok((journal::Key::Device(d.unique_name.clone()), line))
        });
        match line {
            Ok((key, line)) => {
                out.live.insert(key, line);
                out.files.push(file);
            }
            Err(e) => out.corrupt.push(corrupt(&file, None, e)),
        }
    }
    out
}

fn read_dir(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .collect();
    out.sort();
    out
}

fn read_json<T: serde::de::DeserializeOwned>(file: &Path) -> Result<T, journal::FormatError> {
    #[derive(Deserialize)]
    struct Versioned {
        version: u32,
    }
    let bytes = std::fs::read(file)?;
    let v: Versioned = serde_json::from_slice(&bytes)?;
    if v.version != VERSION {
        return Err(journal::FormatError::Version { found: v.version });
    }
    Ok(serde_json::from_slice(&bytes)?)
}

#[cfg(test)]
mod tests;
