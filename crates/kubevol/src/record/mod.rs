//! The durable record: what kubevol intends to do and has done on the node, kept under
//! `<root>/volume-record/` so that a crash at any instant leaves evidence for reconstruction.
//!
//! ```text
//! <root>/volume-record/pods/<pod uid>/<volume>.<hash of unique name>.json
//! <root>/volume-record/volumes/<hash of unique name>.json
//! ```
//!
//! One small, versioned JSON file per pod volume and per node-wide volume (attach, CSI stage).
//! Before a side effect the intent is written durably: a temporary file, fsync, rename over the
//! old record, fsync of the directory. After the side effect the record is rewritten to say
//! what the actual state now holds (or removed when nothing is left); that second write needs
//! no fsync, because losing it only brings back the intent, and an intent means "uncertain",
//! which reconstruction handles the same way. A record that cannot be parsed is reported and
//! treated as uncertain: its file name still says which pod and volume it was about.
//!
//! Operations hand their changes to one writer thread ([`Record::commit`]), which applies all
//! changes queued at that moment as one batch: a storm of set-ups pays for one journal commit
//! per batch, not one per volume, and no operation blocks a runtime thread on the disk.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use k8s_openapi::api::core::v1::{PersistentVolume, Volume};
use kubevol_core::state::{
    ActualVolume, DeviceMountState, MountedPodVolume, SubPathMount, VolumeSpec, VolumeTraits,
};
use kubevol_core::{PodRef, PodUid, UniqueVolumeName};
use serde::{Deserialize, Serialize};
use sha2::Digest;

mod fail;
mod writer;

pub use fail::{fail_point, FAIL_POINTS, FAIL_POINT_ENV};
pub use writer::Change;
use writer::Job;

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

/// A volume's spec as recorded (the pod's volume, and the PV a claim resolved to).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpecRecord {
    /// The pod's `spec.volumes[]` entry.
    pub volume: Volume,
    /// The PersistentVolume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume: Option<PersistentVolume>,
    /// A raw block volume.
    #[serde(default)]
    pub block: bool,
}

impl SpecRecord {
    /// The record of a spec.
    pub fn of(spec: &VolumeSpec) -> Self {
        SpecRecord {
            volume: spec.volume.clone(),
            persistent_volume: spec.persistent_volume.as_deref().cloned(),
            block: spec.block,
        }
    }

    /// The spec it records.
    pub fn spec(&self) -> VolumeSpec {
        VolumeSpec {
            volume: self.volume.clone(),
            persistent_volume: self.persistent_volume.clone().map(std::sync::Arc::new),
            block: self.block,
            extensions: Default::default(),
        }
    }
}

/// The plugin facts of a volume.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TraitsRecord {
    /// The plugin.
    pub plugin: String,
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
    pub source: String,
    /// The volume's name in the pod's spec.
    pub volume: String,
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
        source: String,
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
    /// The file.
    pub path: PathBuf,
    /// The pod it was about (pod records).
    pub pod: Option<PodUid>,
    /// The volume's name in the pod's spec (pod records).
    pub volume: Option<String>,
    /// What is wrong with it.
    pub error: String,
}

impl std::fmt::Display for CorruptRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "record {}", self.path.display())?;
        if let (Some(pod), Some(volume)) = (&self.pod, &self.volume) {
            write!(f, " (volume {volume:?} of pod {pod})")?;
        }
        write!(
            f,
            " cannot be read ({}); its volume is treated as possibly mounted and reconstructed from the pods directory and the mount table. The file is replaced when the volume is recorded again; remove it by hand once nothing of it is mounted",
            self.error
        )
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

fn short_hash(s: &str) -> String {
    let d = sha2::Sha256::digest(s.as_bytes());
    d.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// The record under one root directory.
pub struct Record {
    dir: PathBuf,
    /// What each file was last written with, so an unchanged record is not written again.
    written: Mutex<BTreeMap<PathBuf, Vec<u8>>>,
    /// The writer thread's queue, started by the first [`Record::commit`].
    queue: OnceLock<Mutex<std::sync::mpsc::Sender<Job>>>,
    /// The record files of each directory, by key (see [`record_key`]): a directory is listed
    /// once, then kept up to date by the writer, so that finding a record's other names costs
    /// no listing per write (a pod with thousands of volumes would make that quadratic).
    names: Mutex<HashMap<PathBuf, HashMap<String, BTreeSet<PathBuf>>>>,
}

impl Record {
    /// The record under `root`; its directories are made if missing.
    pub fn open(root: &Path) -> std::io::Result<Self> {
        let dir = root.join(RECORD_DIR);
        std::fs::create_dir_all(dir.join("pods"))?;
        std::fs::create_dir_all(dir.join("volumes"))?;
        Ok(Record {
            dir,
            written: Mutex::default(),
            queue: OnceLock::new(),
            names: Mutex::default(),
        })
    }

    /// The record's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn pod_file(&self, uid: &PodUid, volume: &str, unique: &UniqueVolumeName) -> PathBuf {
        self.dir
            .join("pods")
            .join(uid.as_str())
            .join(format!("{volume}.{}.json", short_hash(unique.as_str())))
    }

    fn device_file(&self, unique: &UniqueVolumeName) -> PathBuf {
        self.dir
            .join("volumes")
            .join(format!("{}.json", short_hash(unique.as_str())))
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
        let file = self.device_file(unique);
        let cached = crate::sync::lock(&self.written).get(&file).cloned();
        let bytes = match cached {
            Some(b) => b,
            None => std::fs::read(&file).ok()?,
        };
        serde_json::from_slice(&bytes).ok()
    }

    /// Whether a pod volume's record on disk already says exactly `r` (checked in memory, so
    /// that an unchanged outcome costs no write and no blocking call).
    pub fn holds_pod_volume(&self, r: &PodVolumeRecord) -> bool {
        let file = self.pod_file(&r.pod.uid, &r.volume, &r.unique_name);
        encode(r).is_ok_and(|b| crate::sync::lock(&self.written).get(&file) == Some(&b))
    }

    /// Reads every record. Unreadable ones are returned as [`CorruptRecord`]s and left in
    /// place (they are replaced when their volume is recorded again).
    pub fn load(&self) -> Loaded {
        let mut out = Loaded::default();
        let corrupt = |path: &Path, pod: Option<PodUid>, error: String| {
            let volume = pod.as_ref().and_then(|_| {
                let name = path.file_name()?.to_str()?;
                Some(name.split('.').next()?.to_string())
            });
            CorruptRecord {
                path: path.to_path_buf(),
                pod,
                volume,
                error,
            }
        };
        let is_record = |p: &Path| p.extension().is_some_and(|e| e == "json");
        // A temporary file is a write that was interrupted before its rename: its side effect
        // never started (it waits for the rename and the fsync), so it is dropped.
        let drop_partial = |dir: &Path| {
            for p in read_dir(dir) {
                if p.extension().is_some_and(|e| e == "tmp") {
                    let _ = std::fs::remove_file(&p);
                }
            }
        };
        drop_partial(&self.dir.join("volumes"));
        for pod_dir in read_dir(&self.dir.join("pods")) {
            drop_partial(&pod_dir);
        }
        for pod_dir in read_dir(&self.dir.join("pods")) {
            let Some(uid) = pod_dir.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let uid = PodUid(uid.to_string());
            for file in read_dir(&pod_dir).into_iter().filter(|p| is_record(p)) {
                match read_json::<PodVolumeRecord>(&file) {
                    Ok(r) if r.pod.uid == uid => out.pods.push(r),
                    Ok(r) => out.corrupt.push(corrupt(
                        &file,
                        Some(uid.clone()),
                        format!(
                            "it is about pod {} but lies in {}'s directory",
                            r.pod.uid, uid
                        ),
                    )),
                    Err(e) => out.corrupt.push(corrupt(&file, Some(uid.clone()), e)),
                }
            }
        }
        for file in read_dir(&self.dir.join("volumes"))
            .into_iter()
            .filter(|p| is_record(p))
        {
            match read_json::<DeviceRecord>(&file) {
                Ok(r) => out.devices.push(r),
                Err(e) => out.corrupt.push(corrupt(&file, None, e)),
            }
        }
        out
    }
}

/// A record as it is written: pretty JSON and a newline.
fn encode<T: Serialize>(value: &T) -> std::io::Result<Vec<u8>> {
    let mut bytes = serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?;
    bytes.push(b'\n');
    Ok(bytes)
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

fn read_json<T: serde::de::DeserializeOwned>(file: &Path) -> Result<T, String> {
    #[derive(Deserialize)]
    struct Versioned {
        version: u32,
    }
    let bytes = std::fs::read(file).map_err(|e| e.to_string())?;
    let v: Versioned = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    if v.version != VERSION {
        return Err(format!(
            "format version {} is not {VERSION}, the one this kubevol writes",
            v.version
        ));
    }
    serde_json::from_slice(&bytes).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod_record(uid: &str, volume: &str) -> PodVolumeRecord {
        PodVolumeRecord {
            version: VERSION,
            state: PodVolumeState::SettingUp,
            pod: PodRef {
                namespace: "default".into(),
                name: "web".into(),
                uid: PodUid(uid.into()),
            },
            source: "/m/web.yaml, document 1".into(),
            volume: volume.into(),
            unique_name: UniqueVolumeName(format!("kubernetes.io/empty-dir/{uid}-{volume}")),
            traits: TraitsRecord {
                plugin: "kubernetes.io/empty-dir".into(),
                attachable: false,
                device_mountable: false,
            },
            path: PathBuf::from("/r/pods/x/volumes/kubernetes.io~empty-dir/cache"),
            read_only: false,
            sub_paths: Vec::new(),
            spec: SpecRecord {
                volume: Volume {
                    name: volume.into(),
                    ..Default::default()
                },
                persistent_volume: None,
                block: false,
            },
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_commits_are_batched_and_keep_their_order_per_file() {
        let t = tempfile::tempdir().unwrap();
        let rec = Arc::new(Record::open(t.path()).unwrap());
        // Many pods at once, each an intent then its outcome.
        let mut tasks = Vec::new();
        for i in 0..300 {
            let rec = rec.clone();
            tasks.push(tokio::spawn(async move {
                let mut r = pod_record(&format!("uid-{i}"), "cache");
                rec.commit(Change::PodVolume(r.clone()), true).await?;
                r.state = PodVolumeState::SetUp;
                rec.commit(Change::PodVolume(r), false).await
            }));
        }
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        // Two changes to one file submitted together: applied in the order submitted.
        let mut last = pod_record("uid-0", "cache");
        last.state = PodVolumeState::TearingDown;
        let (a, b) = tokio::join!(
            rec.commit(
                Change::RemovePodVolume {
                    pod: PodUid("uid-1".into()),
                    volume: "cache".into(),
                    unique: pod_record("uid-1", "cache").unique_name,
                },
                false
            ),
            rec.commit(Change::PodVolume(last), true)
        );
        a.unwrap();
        b.unwrap();
        let loaded = Record::open(t.path()).unwrap().load();
        assert!(loaded.corrupt.is_empty(), "{:?}", loaded.corrupt);
        assert_eq!(loaded.pods.len(), 299, "uid-1 removed");
        let state = |uid: &str| {
            loaded
                .pods
                .iter()
                .find(|p| p.pod.uid.0 == uid)
                .map(|p| p.state)
        };
        assert_eq!(state("uid-0"), Some(PodVolumeState::TearingDown));
        assert_eq!(state("uid-1"), None);
        assert_eq!(state("uid-299"), Some(PodVolumeState::SetUp));
        assert!(
            !t.path().join(RECORD_DIR).join("pods/uid-1").exists(),
            "an empty pod directory is removed"
        );
        let leftovers = read_dir(&t.path().join(RECORD_DIR).join("pods/uid-7"));
        assert_eq!(leftovers.len(), 1, "no temporary file left: {leftovers:?}");
    }

    #[tokio::test]
    async fn records_round_trip_and_are_human_readable() {
        let t = tempfile::tempdir().unwrap();
        let rec = Arc::new(Record::open(t.path()).unwrap());
        let mut r = pod_record("u1", "cache");
        rec.commit(Change::PodVolume(r.clone()), true)
            .await
            .unwrap();
        r.state = PodVolumeState::SetUp;
        rec.commit(Change::PodVolume(r.clone()), false)
            .await
            .unwrap();
        let files = read_dir(&t.path().join(RECORD_DIR).join("pods").join("u1"));
        assert_eq!(files.len(), 1, "one file per pod volume: {files:?}");
        let text = std::fs::read_to_string(&files[0]).unwrap();
        assert!(text.contains("\"version\": 1"), "{text}");
        assert!(text.contains("\"state\": \"setUp\""), "{text}");
        let loaded = rec.load();
        assert_eq!(loaded.pods.len(), 1);
        assert_eq!(loaded.pods[0].state, PodVolumeState::SetUp);
        // The same volume recorded under its directory's name replaces the first record.
        let mut renamed = r.clone();
        renamed.volume = "cache-dir".into();
        rec.commit(Change::PodVolume(renamed), false).await.unwrap();
        let loaded = rec.load();
        assert_eq!(loaded.pods.len(), 1);
        assert_eq!(loaded.pods[0].volume, "cache-dir");
        let removal = Change::RemovePodVolume {
            pod: r.pod.uid.clone(),
            volume: r.volume.clone(),
            unique: r.unique_name.clone(),
        };
        rec.commit(removal, false).await.unwrap();
        assert!(rec.load().pods.is_empty());
        assert!(
            !t.path().join(RECORD_DIR).join("pods").join("u1").exists(),
            "the pod's record directory goes with its last record"
        );
    }

    #[tokio::test]
    async fn corrupt_truncated_and_foreign_version_records_are_reported_with_their_pod() {
        let t = tempfile::tempdir().unwrap();
        let rec = Arc::new(Record::open(t.path()).unwrap());
        let r = pod_record("u1", "cache");
        rec.commit(Change::PodVolume(r), true).await.unwrap();
        let file = read_dir(&t.path().join(RECORD_DIR).join("pods").join("u1"))[0].clone();
        let text = std::fs::read_to_string(&file).unwrap();
        for bad in [
            text[..text.len() / 2].to_string(),
            String::new(),
            text.replace("\"version\": 1", "\"version\": 7"),
        ] {
            std::fs::write(&file, &bad).unwrap();
            let loaded = rec.load();
            assert!(loaded.pods.is_empty());
            assert_eq!(loaded.corrupt.len(), 1, "{bad}");
            let c = &loaded.corrupt[0];
            assert_eq!(c.pod, Some(PodUid("u1".into())));
            assert_eq!(c.volume.as_deref(), Some("cache"));
            assert!(c.to_string().contains("possibly mounted"), "{c}");
            assert!(
                c.to_string().contains("(volume \"cache\" of pod u1)"),
                "{c}"
            );
        }
        std::fs::write(
            t.path().join(RECORD_DIR).join("volumes").join("x.json"),
            "{",
        )
        .unwrap();
        let loaded = rec.load();
        assert_eq!(loaded.corrupt.len(), 2);
        assert!(loaded.corrupt.iter().any(|c| c.pod.is_none()));
    }

    #[tokio::test]
    async fn device_records_keep_attach_stage_and_size() {
        let t = tempfile::tempdir().unwrap();
        let rec = Arc::new(Record::open(t.path()).unwrap());
        let name = UniqueVolumeName("kubernetes.io/csi/loop^pv1".into());
        let d = DeviceRecord {
            version: VERSION,
            unique_name: name.clone(),
            traits: TraitsRecord {
                plugin: "kubernetes.io/csi".into(),
                attachable: true,
                device_mountable: true,
            },
            attach: Some(DeviceStepState::Done),
            device_mount: Some(DeviceStepState::Starting),
            device_mount_path: Some("/r/plugins/g".into()),
            publish_context: [("devicePath".to_string(), "/dev/loop3".to_string())].into(),
            expanded_size: Some(1 << 30),
            spec: pod_record("u", "v").spec,
        };
        rec.commit(Change::Device(d.clone()), true).await.unwrap();
        assert_eq!(rec.device(&name).unwrap().expanded_size, Some(1 << 30));
        let loaded = Record::open(t.path()).unwrap().load();
        assert_eq!(loaded.devices.len(), 1);
        assert_eq!(
            loaded.devices[0].device_mount,
            Some(DeviceStepState::Starting)
        );
        assert_eq!(
            loaded.devices[0].publish_context["devicePath"],
            "/dev/loop3"
        );
        let later = DeviceRecord {
            expanded_size: None,
            device_mount: Some(DeviceStepState::Done),
            ..d.clone()
        };
        rec.commit(Change::Device(later), false).await.unwrap();
        assert_eq!(
            rec.device(&name).unwrap().expanded_size,
            Some(1 << 30),
            "a later write keeps the recorded size"
        );
        rec.set_expanded_size(&name, 2 << 30).await.unwrap();
        let loaded = Record::open(t.path()).unwrap().load();
        assert_eq!(loaded.devices[0].expanded_size, Some(2 << 30));
        rec.commit(Change::RemoveDevice(name.clone()), false)
            .await
            .unwrap();
        assert!(rec.load().devices.is_empty());
    }
}
