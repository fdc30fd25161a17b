//! The record's writer: one thread appends the changes all operations queue to the journal,
//! as batches (one write, and one `fdatasync` when the batch holds an intent), so a storm pays
//! one journal commit per batch and no runtime thread waits on the disk.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use kubevol_core::{PodUid, UniqueVolumeName};

use super::journal::{AppendError, Appender, Key, Line, LineRef, Live, Place};
use super::{DeviceRecord, PodVolumeRecord, Record, Writer};

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
        volume: kubevol_core::names::SharedStr,
        /// The volume.
        unique: UniqueVolumeName,
    },
    /// Write a volume's node-wide record (without `expanded_size`, the size recorded before
    /// is kept).
    Device(DeviceRecord),
    /// Remove a volume's node-wide record.
    RemoveDevice(UniqueVolumeName),
}

impl Change {
    fn key(&self) -> Key {
        match self {
            Change::PodVolume(r) => Key::Pod(r.pod.uid.clone(), r.unique_name.clone()),
            Change::RemovePodVolume { pod, unique, .. } => Key::Pod(pod.clone(), unique.clone()),
            Change::Device(r) => Key::Device(r.unique_name.clone()),
            Change::RemoveDevice(unique) => Key::Device(unique.clone()),
        }
    }

    /// Whether it records the intent to start something new on the node (a set-up, an attach,
    /// a device mount), which waits while the disk is full: what finishes or undoes earlier
    /// work, and frees space, is written into the journal's reserve.
    fn starts(&self) -> bool {
        use super::{DeviceStepState as D, PodVolumeState as P};
        match self {
            Change::PodVolume(r) => r.state == P::SettingUp,
            Change::Device(r) => {
                r.attach == Some(D::Starting) || r.device_mount == Some(D::Starting)
            }
            Change::RemovePodVolume { .. } | Change::RemoveDevice(_) => false,
        }
    }
}

/// Why a change that [`Change::starts`] something is refused while the journal's disk is full.
fn full(dir: &std::path::Path) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::StorageFull,
        format!(
            "No space left on device: the disk holding the volume record ({}) is full; its reserve is kept for teardowns, and set-ups wait until space is freed",
            dir.display()
        ),
    )
}

/// What the writer thread is sent: one change, or many queued together (never split between
/// two batches, so they cost one wake-up of the writer and share one journal commit).
pub(super) enum Job {
    One {
        /// The change; none for [`Record::flush`]'s marker.
        change: Option<Change>,
        durable: bool,
        /// Who waits for the result; without one, a failure is logged.
        reply: Option<tokio::sync::oneshot::Sender<std::io::Result<()>>>,
    },
    Many {
        changes: Vec<Change>,
        durable: bool,
        /// Who waits for the results; without one, failures are logged.
        reply: Option<Answering>,
    },
}

impl Job {
    /// Its changes (none for a flush's marker), and whether they are durable.
    fn changes(&self) -> (&[Change], bool) {
        match self {
            Job::One {
                change, durable, ..
            } => (change.as_slice(), *durable),
            Job::Many {
                changes, durable, ..
            } => (changes, *durable),
        }
    }
}

/// The results of changes queued together by [`Record::queue_durable_all`], for a thread
/// outside the async runtime: one wait for all of them, each read by its index.
#[derive(Default)]
pub struct Answers {
    results: Mutex<Option<Vec<std::io::Result<()>>>>,
    done: std::sync::Condvar,
}

impl Answers {
    fn answer(&self, results: Vec<std::io::Result<()>>) {
        *crate::sync::lock(&self.results) = Some(results);
        self.done.notify_all();
    }
}

/// The writer's end of an [`Answers`]: answers once, and if it is dropped unanswered (the
/// writer thread stopped first) every change fails with "stopped".
pub(super) struct Answering {
    answers: Arc<Answers>,
    count: usize,
}

impl Answering {
    fn answer(mut self, results: Vec<std::io::Result<()>>) {
        self.answers.answer(results);
        self.count = 0;
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        if self.count > 0 {
            self.answers
                .answer((0..self.count).map(|_| Err(stopped())).collect());
        }
    }
}

/// A durable change queued by [`Record::queue_durable_all`].
pub struct Committed {
    answers: Arc<Answers>,
    index: usize,
}

impl Committed {
    /// Whether the record has answered: [`Committed::wait`] would not block.
    pub fn answered(&self) -> bool {
        crate::sync::lock(&self.answers.results).is_some()
    }

    /// Blocks until the change is on disk, or says why it is not. Not on the async runtime.
    pub fn wait(self) -> std::io::Result<()> {
        let mut results = crate::sync::lock(&self.answers.results);
        loop {
            if let Some(results) = results.as_ref() {
                return match results.get(self.index) {
                    Some(Ok(())) => Ok(()),
                    Some(Err(e)) => Err(copy_error(e)),
                    None => Err(stopped()),
                };
            }
            results = self
                .answers
                .done
                .wait(results)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

/// The most changes one batch takes, so that a storm's first intents are not held up by its
/// last.
const MAX_BATCH: usize = 1024;

/// The writer thread: takes every change queued, applies them as one batch, answers each,
/// and repeats; it ends when the record, which holds the queue's sending end, is dropped. It
/// holds the live records and the journal, never the record itself, so the record's last
/// owner is never this thread and always waits for it to end.
fn write_batches(
    live: &Mutex<Live>,
    dir: &std::path::Path,
    mut journal: Appender,
    rx: &std::sync::mpsc::Receiver<Job>,
) {
    while let Ok(first) = rx.recv() {
        let mut queued = first.changes().0.len();
        let mut jobs = vec![first];
        while queued < MAX_BATCH {
            match rx.try_recv() {
                Ok(job) => {
                    queued += job.changes().0.len();
                    jobs.push(job);
                }
                Err(_) => break,
            }
        }
        let batch: Vec<(&Change, bool)> = jobs
            .iter()
            .flat_map(|j| {
                let (changes, durable) = j.changes();
                changes.iter().map(move |c| (c, durable))
            })
            .collect();
        let results = apply(live, &mut journal, &batch);
        journal.maybe_compact(live);
        let mut results = results.into_iter();
        let failed = |e: std::io::Error| tracing::warn!(dir = %dir.display(), "cannot update the volume record: {e}");
        for job in jobs {
            match job {
                Job::One { change, reply, .. } => {
                    let result = match change {
                        Some(_) => results.next().unwrap_or(Ok(())),
                        None => Ok(()),
                    };
                    match (reply, result) {
                        (Some(reply), result) => {
                            let _ = reply.send(result);
                        }
                        (None, Err(e)) => failed(e),
                        (None, Ok(())) => {}
                    }
                }
                Job::Many { changes, reply, .. } => {
                    let mine: Vec<std::io::Result<()>> = changes
                        .iter()
                        .map(|_| results.next().unwrap_or(Ok(())))
                        .collect();
                    match reply {
                        Some(reply) => reply.answer(mine),
                        None => mine.into_iter().filter_map(Result::err).for_each(failed),
                    }
                }
            }
        }
    }
}

/// Applies a batch of changes in order and returns each one's result: their lines are
/// appended in one write, synced once if any change is `durable` (a durable change is on
/// disk when its result is returned). A change that would not alter a record (an unchanged
/// outcome, the removal of a record that is not there) writes nothing.
fn apply(
    live: &Mutex<Live>,
    journal: &mut Appender,
    batch: &[(&Change, bool)],
) -> Vec<std::io::Result<()>> {
    let mut results: Vec<std::io::Result<()>> = Vec::with_capacity(batch.len());
    // What the batch changes, in order, over the live records: each key's line, where it
    // lies in `buf` (none: removed).
    let mut changed: Vec<(Key, Option<Range<usize>>)> = Vec::new();
    let mut overlay: kubevol_core::collections::HashMap<Key, Option<Range<usize>>> =
        Default::default();
    // The batch's lines, each encoded in place (about 600 bytes a pod volume's record).
    let mut buf = Vec::with_capacity(batch.len() * 640);
    let mut any_durable = false;
    let short = !journal.refill();
    {
        let live = crate::sync::lock(live);
        let file = live.file();
        for &(change, durable) in batch {
            if short && change.starts() {
                results.push(Err(full(journal.dir())));
                continue;
            }
            let key = change.key();
            let begins = buf.len();
            let now = match overlay.get(&key) {
                Some(line) => Now::Batch(line.clone()),
                None => Now::At(live.place(&key)),
            };
            let encoded = match change {
                Change::PodVolume(r) => LineRef::PodVolume(r).encode_into(&mut buf).map(|()| true),
                Change::Device(r) if r.expanded_size.is_none() => {
                    let kept =
                        now.bytes(&file, &buf)
                            .and_then(|b| match super::journal::parse(&b) {
                                Ok(Line::Device(d)) => d.expanded_size,
                                _ => None,
                            });
                    let r = DeviceRecord {
                        expanded_size: kept,
                        ..r.clone()
                    };
                    LineRef::Device(&r).encode_into(&mut buf).map(|()| true)
                }
                Change::Device(r) => LineRef::Device(r).encode_into(&mut buf).map(|()| true),
                Change::RemovePodVolume { .. } | Change::RemoveDevice(_) => Ok(false),
            };
            let record = match encoded {
                Ok(record) => record,
                Err(e) => {
                    buf.truncate(begins);
                    results.push(Err(e));
                    continue;
                }
            };
            results.push(Ok(()));
            if record {
                // Unchanged: an outcome needs no write; an intent is written and synced
                // all the same (the caller asked for it to be on disk).
                let (before, line) = buf.split_at(begins);
                if !durable && now.is(&file, before, line) {
                    buf.truncate(begins);
                    continue;
                }
            } else {
                if now.is_none() {
                    continue;
                }
                let removal = match change {
                    Change::RemovePodVolume { pod, unique, .. } => {
                        LineRef::RemovePodVolume { pod, unique }
                    }
                    Change::RemoveDevice(unique) => LineRef::RemoveDevice { unique },
                    _ => unreachable!("only removals have no line"),
                };
                if let Err(e) = removal.encode_into(&mut buf) {
                    buf.truncate(begins);
                    *results.last_mut().expect("pushed above") = Err(e);
                    continue;
                }
            }
            let line = record.then_some(begins..buf.len());
            buf.push(b'\n');
            any_durable |= durable;
            overlay.insert(key.clone(), line.clone());
            changed.push((key, line));
        }
    }
    if buf.is_empty() {
        return results;
    }
    let start = journal.end();
    let unsynced = match journal.append(&buf, changed.len(), any_durable) {
        Ok(()) => None,
        Err(AppendError::NotWritten(e)) => {
            // Nothing of the batch is in the journal: no change happened.
            for r in results.iter_mut().filter(|r| r.is_ok()) {
                *r = Err(copy_error(&e));
            }
            return results;
        }
        Err(AppendError::NotSynced(e)) => Some(e),
    };
    // The lines are in the journal (synced or not): the live records follow them.
    let places: Vec<(Key, Option<Place>)> = changed
        .into_iter()
        .map(|(key, line)| {
            let place = line.map(|r| Place::of(start + r.start as u64, &buf[r]));
            (key, place)
        })
        .collect();
    let mut live = crate::sync::lock(live);
    for (key, place) in places {
        live.set(key, place);
    }
    drop(live);
    if let Some(e) = unsynced {
        for (r, &(_, durable)) in results.iter_mut().zip(batch) {
            if durable && r.is_ok() {
                *r = Err(copy_error(&e));
            }
        }
    }
    results
}

/// A key's line as a batch sees it: written earlier in the batch (where it lies in the batch's
/// buffer), or live in the journal (or none).
enum Now {
    Batch(Option<Range<usize>>),
    At(Option<Place>),
}

impl Now {
    fn is_none(&self) -> bool {
        matches!(self, Now::Batch(None) | Now::At(None))
    }

    /// Whether the line is `line` (`batch`: the batch's lines before it).
    fn is(&self, journal: &std::fs::File, batch: &[u8], line: &[u8]) -> bool {
        match self {
            Now::Batch(r) => r.clone().is_some_and(|r| &batch[r] == line),
            Now::At(p) => p.is_some_and(|p| p.holds(journal, line)),
        }
    }

    /// The line's bytes.
    fn bytes(&self, journal: &std::fs::File, batch: &[u8]) -> Option<Vec<u8>> {
        match self {
            Now::Batch(r) => r.clone().map(|r| batch[r].to_vec()),
            Now::At(p) => p.and_then(|p| p.read(journal).ok()),
        }
    }
}

impl Record {
    /// Applies `change` on the record's writer thread, batched with the changes other
    /// operations submit meanwhile (one journal commit for all of them), and returns when it
    /// is done: for a `durable` change, when it is on disk.
    pub async fn commit(self: &Arc<Self>, change: Change, durable: bool) -> std::io::Result<()> {
        let done = self.queue_answered(change, durable)?;
        done.await.unwrap_or_else(|_| Err(stopped()))
    }

    /// Queues `changes` to be written durably, together (one wake-up of the writer, one
    /// journal commit), for a thread outside the async runtime: the caller goes on and waits
    /// for each with [`Committed::wait`] before its side effect.
    pub fn queue_durable_all(
        self: &Arc<Self>,
        changes: Vec<Change>,
    ) -> std::io::Result<Vec<Committed>> {
        let answers = Arc::new(Answers::default());
        let count = changes.len();
        self.send(Job::Many {
            changes,
            durable: true,
            reply: Some(Answering {
                answers: answers.clone(),
                count,
            }),
        })?;
        Ok((0..count)
            .map(|index| Committed {
                answers: answers.clone(),
                index,
            })
            .collect())
    }

    /// Queues `change` with a channel its result is sent on.
    fn queue_answered(
        self: &Arc<Self>,
        change: Change,
        durable: bool,
    ) -> std::io::Result<tokio::sync::oneshot::Receiver<std::io::Result<()>>> {
        let (reply, done) = tokio::sync::oneshot::channel();
        self.enqueue(Some(change), durable, Some(reply))?;
        Ok(done)
    }

    /// Returns once every change queued before it has been applied.
    pub async fn flush(self: &Arc<Self>) {
        let (reply, done) = tokio::sync::oneshot::channel();
        if self.enqueue(None, false, Some(reply)).is_ok() {
            let _ = done.await;
        }
    }

    /// Queues `change` for the writer thread without waiting for it: for an outcome, whose
    /// loss only brings back its intent. Changes are applied in the order they are queued, so
    /// a later intent of the same volume always follows it; a failure is logged.
    pub fn submit(self: &Arc<Self>, change: Change) {
        if let Err(e) = self.enqueue(Some(change), false, None) {
            tracing::warn!(dir = %self.dir.display(), "cannot update the volume record: {e}");
        }
    }

    /// [`Record::submit`] for many changes at once (one wake-up of the writer).
    pub fn submit_all(self: &Arc<Self>, changes: Vec<Change>) {
        if changes.is_empty() {
            return;
        }
        let sent = self.send(Job::Many {
            changes,
            durable: false,
            reply: None,
        });
        if let Err(e) = sent {
            tracing::warn!(dir = %self.dir.display(), "cannot update the volume record: {e}");
        }
    }

    fn enqueue(
        self: &Arc<Self>,
        change: Option<Change>,
        durable: bool,
        reply: Option<tokio::sync::oneshot::Sender<std::io::Result<()>>>,
    ) -> std::io::Result<()> {
        self.send(Job::One {
            change,
            durable,
            reply,
        })
    }

    /// Sends `job` to the writer thread, started by the first.
    fn send(self: &Arc<Self>, job: Job) -> std::io::Result<()> {
        let writer = self.writer.get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel::<Job>();
            let (live, dir) = (self.live.clone(), self.dir.clone());
            let thread = match crate::sync::lock(&self.appender).take() {
                Some(journal) => std::thread::Builder::new()
                    .name("kubevol-record".into())
                    .spawn(move || write_batches(&live, &dir, journal, &rx))
                    .inspect_err(|e| tracing::error!("cannot start the record writer thread: {e}"))
                    .ok(),
                None => {
                    tracing::error!("the record's journal is not open");
                    None
                }
            };
            Writer {
                queue: Mutex::new(tx),
                thread,
            }
        });
        crate::sync::lock(&writer.queue)
            .send(job)
            .map_err(|_| stopped())
    }
}

/// The same error again (an `io::Error` is not `Clone`): its kind and message, for each of the
/// changes one failure stopped.
pub(crate) fn copy_error(e: &std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), e.to_string())
}

fn stopped() -> std::io::Error {
    std::io::Error::other("the record writer thread has stopped")
}
