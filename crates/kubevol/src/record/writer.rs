//! The record's writer: one thread applies the changes all operations queue, as batches
//! (temporary files written, then fsync'd, renamed, each directory fsync'd once, then
//! removals), so a storm pays one journal commit per batch and no runtime thread waits on the
//! disk.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kubevol_core::{PodUid, UniqueVolumeName};

use super::{encode, read_dir, DeviceRecord, PodVolumeRecord, Record};

/// One change to the record.
#[derive(Clone, Debug)]
pub enum Change {
    /// Write a pod volume's record.
    PodVolume(PodVolumeRecord),
    /// Remove a pod volume's record, whatever volume name it was recorded under.
    RemovePodVolume {
        /// The pod.
        pod: PodUid,
        /// The pod's name for the volume.
        volume: String,
        /// The volume.
        unique: UniqueVolumeName,
    },
    /// Write a volume's node-wide record (without `expanded_size`, the size recorded before
    /// is kept).
    Device(DeviceRecord),
    /// Remove a volume's node-wide record.
    RemoveDevice(UniqueVolumeName),
}

/// A change waiting for the writer thread.
pub(super) struct Job {
    change: Change,
    durable: bool,
    reply: tokio::sync::oneshot::Sender<std::io::Result<()>>,
}

/// The most changes one batch takes, so that a storm's first writes are not held up by its
/// last.
const MAX_BATCH: usize = 256;

/// The writer thread: takes every change queued, applies them as one batch, answers each,
/// and repeats. A change to a file already in the batch waits for the next one. It holds the
/// record only while applying, and ends when the record is dropped.
fn write_batches(record: &std::sync::Weak<Record>, rx: &std::sync::mpsc::Receiver<Job>) {
    let mut carried: Option<Job> = None;
    loop {
        let first = match carried.take() {
            Some(job) => job,
            None => match rx.recv() {
                Ok(job) => job,
                Err(_) => return,
            },
        };
        let Some(rec) = record.upgrade() else {
            return;
        };
        let mut keys = std::collections::HashSet::from([rec.conflict_key(&first.change)]);
        let mut jobs = vec![first];
        while jobs.len() < MAX_BATCH {
            let Ok(job) = rx.try_recv() else {
                break;
            };
            if keys.insert(rec.conflict_key(&job.change)) {
                jobs.push(job);
            } else {
                carried = Some(job);
                break;
            }
        }
        let batch: Vec<(&Change, bool)> = jobs.iter().map(|j| (&j.change, j.durable)).collect();
        let results = rec.apply(&batch);
        drop(rec);
        for (job, result) in jobs.into_iter().zip(results) {
            let _ = job.reply.send(result);
        }
    }
}

/// What a pod volume's record files have in common whatever volume name they were recorded
/// under: the hash of the unique volume name (`<volume>.<hash>.json`). Volume names may hold
/// dots (a PersistentVolume's name), so it is taken from the end.
fn record_key(file: &Path) -> Option<&str> {
    let name = file.file_name()?.to_str()?;
    let stem = name.strip_suffix(".json")?;
    Some(stem.rsplit_once('.').map_or(stem, |(_, hash)| hash))
}

impl Record {
    /// The records of the same pod and volume key under another volume name (a volume
    /// reconstructed from the pods directory knows only its directory's name).
    fn other_names(&self, file: &Path) -> Vec<PathBuf> {
        let (Some(dir), Some(key)) = (file.parent(), record_key(file)) else {
            return Vec::new();
        };
        let mut names = crate::sync::lock(&self.names);
        let known = names.entry(dir.to_path_buf()).or_insert_with(|| {
            let mut by_key: HashMap<String, BTreeSet<PathBuf>> = HashMap::new();
            for f in read_dir(dir) {
                if let Some(k) = record_key(&f) {
                    by_key.entry(k.to_string()).or_default().insert(f.clone());
                }
            }
            by_key
        });
        known
            .get(key)
            .into_iter()
            .flatten()
            .filter(|f| f.as_path() != file)
            .cloned()
            .collect()
    }

    /// Keeps [`Record::names`] up to date with a file written (`present`) or removed.
    fn note(&self, file: &Path, present: bool) {
        let (Some(dir), Some(key)) = (file.parent(), record_key(file)) else {
            return;
        };
        let mut names = crate::sync::lock(&self.names);
        // A directory not listed yet is listed when it is first asked about.
        let Some(known) = names.get_mut(dir) else {
            return;
        };
        let set = known.entry(key.to_string()).or_default();
        if present {
            set.insert(file.to_path_buf());
        } else {
            set.remove(file);
            if set.is_empty() {
                known.remove(key);
            }
        }
    }

    /// The file a change is about.
    fn file_of(&self, change: &Change) -> PathBuf {
        match change {
            Change::PodVolume(r) => self.pod_file(&r.pod.uid, &r.volume, &r.unique_name),
            Change::RemovePodVolume {
                pod,
                volume,
                unique,
            } => self.pod_file(pod, volume, unique),
            Change::Device(r) => self.device_file(&r.unique_name),
            Change::RemoveDevice(unique) => self.device_file(unique),
        }
    }

    /// Changes two jobs of one batch must not share: a pod volume's record under any of its
    /// names, or a node-wide record.
    fn conflict_key(&self, change: &Change) -> (PathBuf, String) {
        let file = self.file_of(change);
        let key = record_key(&file).unwrap_or_default().to_string();
        (file.parent().unwrap_or(&self.dir).to_path_buf(), key)
    }

    /// Applies a batch of changes to different files and returns each one's result. A durable
    /// write is on disk when its result is returned: every temporary file of the batch is
    /// written first, then the durable ones are fsync'd, then all are renamed into place, then
    /// each directory holding a durable one is fsync'd once. The filesystem's journal commits the
    /// whole batch in the first of those fsyncs, so a batch costs about as much as one write.
    /// Removals (a record's other names, removed records) come after the renames and their
    /// fsync, so a crash never leaves a volume without any record of it.
    fn apply(&self, batch: &[(&Change, bool)]) -> Vec<std::io::Result<()>> {
        struct Staged {
            job: usize,
            handle: std::fs::File,
            tmp: PathBuf,
            file: PathBuf,
            bytes: Vec<u8>,
            durable: bool,
        }
        let mut results: Vec<std::io::Result<()>> = batch.iter().map(|_| Ok(())).collect();
        let mut staged = Vec::new();
        let mut removals: Vec<(usize, PathBuf)> = Vec::new();
        let mut empty_dirs = Vec::new();
        for (job, &(change, durable)) in batch.iter().enumerate() {
            let file = self.file_of(change);
            let bytes = match change {
                Change::PodVolume(r) => encode(r),
                Change::Device(r) if r.expanded_size.is_none() => {
                    let kept = self.device(&r.unique_name).and_then(|d| d.expanded_size);
                    encode(&DeviceRecord {
                        expanded_size: kept,
                        ..r.clone()
                    })
                }
                Change::Device(r) => encode(r),
                Change::RemovePodVolume { .. } => {
                    removals.push((job, file.clone()));
                    removals.extend(self.other_names(&file).into_iter().map(|f| (job, f)));
                    empty_dirs.extend(file.parent().map(Path::to_path_buf));
                    continue;
                }
                Change::RemoveDevice(_) => {
                    removals.push((job, file));
                    continue;
                }
            };
            if let Change::PodVolume(_) = change {
                removals.extend(self.other_names(&file).into_iter().map(|f| (job, f)));
            }
            let stage = |bytes: std::io::Result<Vec<u8>>| -> std::io::Result<Option<Staged>> {
                let bytes = bytes?;
                if !durable && crate::sync::lock(&self.written).get(&file) == Some(&bytes) {
                    return Ok(None);
                }
                let dir = file.parent().unwrap_or(&self.dir);
                std::fs::create_dir_all(dir)?;
                let tmp = file.with_extension("json.tmp");
                let mut handle = std::fs::File::create(&tmp)?;
                handle.write_all(&bytes)?;
                Ok(Some(Staged {
                    job,
                    handle,
                    tmp,
                    file: file.clone(),
                    bytes,
                    durable,
                }))
            };
            match stage(bytes) {
                Ok(s) => staged.extend(s),
                Err(e) => results[job] = Err(e),
            }
        }
        // All written before any is synced: the first fsync commits them all.
        for s in staged.iter().filter(|s| s.durable) {
            if let Err(e) = s.handle.sync_all() {
                results[s.job] = Err(e);
            }
        }
        let mut synced_dirs: BTreeMap<PathBuf, Vec<usize>> = BTreeMap::new();
        for s in staged {
            if results[s.job].is_err() {
                continue;
            }
            drop(s.handle);
            if let Err(e) = std::fs::rename(&s.tmp, &s.file) {
                results[s.job] = Err(e);
                continue;
            }
            self.note(&s.file, true);
            crate::sync::lock(&self.written).insert(s.file.clone(), s.bytes);
            if s.durable {
                let dir = s.file.parent().unwrap_or(&self.dir).to_path_buf();
                synced_dirs.entry(dir).or_default().push(s.job);
            }
        }
        for (dir, jobs) in synced_dirs {
            if let Err(e) = std::fs::File::open(&dir).and_then(|d| d.sync_all()) {
                for job in jobs {
                    results[job] = Err(std::io::Error::new(e.kind(), e.to_string()));
                }
            }
        }
        for (job, file) in removals {
            if results[job].is_ok() {
                if let Err(e) = self.remove(&file) {
                    results[job] = Err(e);
                }
            }
        }
        for dir in empty_dirs {
            // Fails while another volume of the pod is recorded, as it should.
            if std::fs::remove_dir(&dir).is_ok() {
                crate::sync::lock(&self.names).remove(&dir);
            }
        }
        results
    }

    fn remove(&self, file: &Path) -> std::io::Result<()> {
        crate::sync::lock(&self.written).remove(file);
        self.note(file, false);
        match std::fs::remove_file(file) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Applies `change` on the record's writer thread, batched with the changes other
    /// operations submit meanwhile (one journal commit for all of them), and returns when it
    /// is done: for a `durable` change, when it is on disk.
    pub async fn commit(self: &Arc<Self>, change: Change, durable: bool) -> std::io::Result<()> {
        let queue = self.queue.get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel::<Job>();
            let record = Arc::downgrade(self);
            let spawned = std::thread::Builder::new()
                .name("kubevol-record".into())
                .spawn(move || write_batches(&record, &rx));
            if let Err(e) = spawned {
                tracing::error!("cannot start the record writer thread: {e}");
            }
            Mutex::new(tx)
        });
        let (reply, done) = tokio::sync::oneshot::channel();
        let sent = crate::sync::lock(queue).send(Job {
            change,
            durable,
            reply,
        });
        if sent.is_err() {
            return Err(std::io::Error::other(
                "the record writer thread has stopped",
            ));
        }
        done.await.unwrap_or_else(|_| {
            Err(std::io::Error::other(
                "the record writer thread has stopped",
            ))
        })
    }
}
