//! The watch of the manifest directory (the `manifests` feature): inotify events applied as
//! one change per batch, the given path resolved again whenever an entry on the way to it
//! changes (a directory swapped by a link, as a ConfigMap's mount swaps it; see [`super::way`])
//! and at every listing, and the directory listed again every 20 s. Nothing else wakes it.

use super::parse::manifest_error;
use super::way::{way_of, Way};
use super::{is_manifest_file, read_file, Occasion, ReadLimits};
use crate::source::{BoxFuture, PodSource, Sink};
use crate::store::{Change, FileContent};
use notify::Watcher;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

/// Whether an inotify event leaves a file in a state worth reading: the writer closed it, or it
/// appeared, moved or went away. A plain modification is not: `write(2)` after `O_TRUNC` shows
/// an empty or half-written file, and reading it then would take its pods away. Nor is the
/// event that pairs a rename's two names (`Both`): it comes after the new name's own event,
/// sometimes in the next batch, and would read the file again for nothing.
pub fn settles_file(kind: &notify::EventKind) -> bool {
    use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind, RenameMode};
    match kind {
        EventKind::Modify(ModifyKind::Name(mode)) => *mode != RenameMode::Both,
        _ => matches!(
            kind,
            EventKind::Access(AccessKind::Close(AccessMode::Write))
                | EventKind::Create(_)
                | EventKind::Remove(_)
        ),
    }
}

/// How long reading one file may take before the file is reported and the others are read
/// without it (a file on a hung filesystem).
const READ_STALL: Duration = Duration::from_secs(10);

/// How long the watch waits for the second half of a rename (the new name) before it takes
/// the first half for a file moved out of the directory. Both halves come from one rename(2)
/// and are reported within microseconds; the wait only bounds the case where no second half
/// ever comes.
const RENAME_PAIR_WAIT: Duration = Duration::from_secs(1);

/// Whether a batch of events holds the old name of a rename without its new name.
fn unpaired_rename(batch: &[notify::Result<notify::Event>]) -> bool {
    use notify::event::{EventKind, ModifyKind, RenameMode};
    let tracked = |mode: RenameMode| {
        batch
            .iter()
            .flatten()
            .filter(move |e| e.kind == EventKind::Modify(ModifyKind::Name(mode)))
            .filter_map(|e| e.tracker())
    };
    let mut paired = tracked(RenameMode::To).chain(tracked(RenameMode::Both));
    let paired: BTreeSet<usize> = paired.by_ref().collect();
    tracked(RenameMode::From).any(|t| !paired.contains(&t))
}

/// How often the directory is listed again whatever inotify said (the kubelet's file source
/// re-lists every 20 s): only files whose identity, size or times changed are read, so it costs
/// a `stat` per file when nothing changed. It catches what inotify cannot tell, such as a
/// manifest that is a symbolic link whose target was switched, or a filesystem mounted over an
/// entry on the way to the directory (the path is resolved again with it).
const RELIST_PERIOD: Duration = Duration::from_secs(20);

/// How long a directory just switched to must be quiet before it is listed: a directory
/// replaced by a script (`mkdir new; cp ...`) is read once it is filled, not while empty.
const SWITCH_QUIET: Duration = Duration::from_secs(1);

/// The longest a switch waits for its new directory to be quiet.
const SWITCH_QUIET_MAX: Duration = Duration::from_secs(10);

/// How long a file found empty at its writer's close must stay unchanged before it is applied
/// (and its pods go): the close event may be read after the next writer's `O_TRUNC`, and that
/// writer's own close brings the next read well within it.
const EMPTY_QUIET: Duration = Duration::from_secs(1);

/// A file as `stat` sees it (through links): when none of it changed, neither did the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Signature {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Signature {
    fn of(path: &Path) -> Option<Signature> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).ok()?;
        Some(Signature {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }
}

/// The directory as it is watched: the path it resolved to and its identity.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Resolved {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl Resolved {
    /// Where `given` leads now (every symbolic link on the way followed).
    fn of(given: &Path) -> std::io::Result<Resolved> {
        use std::os::unix::fs::MetadataExt;
        let path = std::fs::canonicalize(given)?;
        let m = std::fs::metadata(&path)?;
        if !m.is_dir() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotADirectory,
                format!("{} is not a directory", path.display()),
            ));
        }
        Ok(Resolved {
            path,
            dev: m.dev(),
            ino: m.ino(),
        })
    }
}

/// A file found empty at its writer's close: what `stat` said of it just before, and when it is
/// read again.
type Held = (Option<Signature>, tokio::time::Instant);

/// Changes read from files, and what `stat` said of each file just before it was read.
type Read = (Vec<Change>, BTreeMap<PathBuf, Option<Signature>>);

/// The manifest-directory source.
#[derive(Clone)]
pub struct ManifestSource {
    /// The directory as the operator gave it (resolved again and again).
    given: PathBuf,
    /// Where it led when last resolved: files are read and named below it.
    dir: PathBuf,
    limits: ReadLimits,
    /// The files this source has delivered (objects or errors), with what `stat` said of each
    /// just before it was read, so that a re-listing can tell the store which are gone and
    /// read only those that changed.
    delivered: Arc<Mutex<BTreeMap<PathBuf, Option<Signature>>>>,
    /// Whether a resolution of the given path is running (on a blocking thread).
    resolving: Arc<std::sync::atomic::AtomicBool>,
    /// Files whose last read failed for a reason that passes (too many open files, an I/O
    /// error), and when each is read again.
    retries: Arc<Mutex<BTreeMap<PathBuf, kubevol_core::backoff::Backoff>>>,
    /// Files found gone and not yet taken away, with when: a removal is applied once the
    /// directory shows it is still there (see [`ManifestSource::deliver`]).
    removals: Arc<Mutex<BTreeMap<PathBuf, tokio::time::Instant>>>,
    /// Files found empty at their writer's close, not applied yet: what `stat` said of each
    /// just before it was read, and when it is read again (see [`EMPTY_QUIET`]).
    held: Arc<Mutex<BTreeMap<PathBuf, Held>>>,
    /// How long a file found empty at its writer's close is held.
    empty_quiet: Duration,
    /// How many times a file was read, since the source was made.
    reads: Arc<std::sync::atomic::AtomicU64>,
    /// How many times a file found empty at its writer's close was held back.
    holds: Arc<std::sync::atomic::AtomicU64>,
}

/// How long after a file is found gone the directory must still be there for its removal to be
/// applied when no other file is read meanwhile: `rm -rf` of the directory unlinks its files
/// first, and they must not take their pods away before the directory's own removal shows.
const REMOVAL_SETTLE: Duration = Duration::from_millis(200);

impl ManifestSource {
    /// The source's name in the store's sync gate.
    pub const NAME: &'static str = "file";

    /// A source for `dir`. Nothing is read until it is started.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        let dir = dir.into();
        ManifestSource {
            given: dir.clone(),
            dir,
            limits: ReadLimits::default(),
            delivered: Arc::default(),
            resolving: Arc::default(),
            retries: Arc::default(),
            removals: Arc::default(),
            held: Arc::default(),
            empty_quiet: EMPTY_QUIET,
            reads: Arc::default(),
            holds: Arc::default(),
        }
    }

    /// How many times this source has read a file, counted while it runs: a directory nobody
    /// writes to is not read again (a `stat` per file at each listing tells what changed).
    pub fn reads(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.reads.clone()
    }

    /// How many times a file found empty at its writer's close was held back rather than
    /// applied (see [`ManifestSource::with_empty_quiet`]).
    pub fn holds(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.holds.clone()
    }

    /// Sets how long a file found empty at its writer's close must stay unchanged before it is
    /// applied (1 s by default). The close event of one writer can be read after the next
    /// writer has truncated the file and before it writes: applied at once, the empty file
    /// would take its pods away until that writer's close. Held instead, it is read again at
    /// the next writer's close, or applied once it has stayed unchanged this long.
    pub fn with_empty_quiet(mut self, quiet: Duration) -> Self {
        self.empty_quiet = quiet;
        self
    }

    /// Sets the largest file read (bigger files are reported, not read).
    pub fn with_max_file_size(mut self, bytes: u64) -> Self {
        self.limits.max_size = bytes;
        self
    }

    /// Follows the files' symbolic links wherever they lead (by default a link is followed only
    /// while it stays beneath the directory: see [`ReadLimits::follow_links`]).
    pub fn with_links_followed(mut self, follow: bool) -> Self {
        self.limits.follow_links = follow;
        self
    }

    /// The directory read: where the given path led when last resolved.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Applies changes read from files, removals only once confirmed: a file read in the same
    /// batch shows that the directory is still there after them, so every removal held back
    /// goes with it (a rename stays one change of the store); a batch of removals alone is held
    /// back ([`ManifestSource::confirm_removals`]). A file read again is no longer removed.
    fn deliver(&self, sink: &Sink, (changes, read): Read) {
        let now = tokio::time::Instant::now();
        let present = changes.iter().any(
            |c| matches!(c, Change::File { content, .. } if !matches!(content, FileContent::Gone)),
        );
        let mut removals = crate::sync::lock(&self.removals);
        let mut changes: Vec<Change> = changes
            .into_iter()
            .filter(|c| match c {
                Change::File {
                    path,
                    content: FileContent::Gone,
                } => {
                    removals.entry(path.clone()).or_insert(now);
                    false
                }
                Change::File { path, .. } => {
                    removals.remove(path);
                    true
                }
                _ => true,
            })
            .collect();
        if present {
            changes.extend(
                std::mem::take(&mut *removals)
                    .into_keys()
                    .map(|path| Change::File {
                        path,
                        content: FileContent::Gone,
                    }),
            );
        }
        drop(removals);
        self.apply(sink, (changes, read));
    }

    /// Applies the removals found at least [`REMOVAL_SETTLE`] ago: called once the given path has
    /// been resolved to the same directory (the loop wakes for it when the first is due), so the
    /// files went, not the directory.
    fn confirm_removals(&self, sink: &Sink) {
        let settled = tokio::time::Instant::now() - REMOVAL_SETTLE;
        let gone: Vec<Change> = {
            let mut removals = crate::sync::lock(&self.removals);
            let due: Vec<PathBuf> = removals
                .iter()
                .filter(|(_, at)| **at <= settled)
                .map(|(p, _)| p.clone())
                .collect();
            due.into_iter()
                .map(|path| {
                    removals.remove(&path);
                    Change::File {
                        path,
                        content: FileContent::Gone,
                    }
                })
                .collect()
        };
        self.apply(sink, (gone, BTreeMap::new()));
    }

    /// Applies changes read from files, remembering which files this source has delivered and
    /// what they were when read (`read`).
    fn apply(&self, sink: &Sink, (changes, read): Read) {
        if changes.is_empty() {
            return;
        }
        {
            let mut delivered = crate::sync::lock(&self.delivered);
            for c in &changes {
                if let Change::File { path, content } = c {
                    match content {
                        FileContent::Gone => {
                            info!(file = %path.display(), "manifest removed");
                            delivered.remove(path)
                        }
                        _ => delivered.insert(path.clone(), read.get(path).copied().flatten()),
                    };
                }
            }
        }
        sink.apply(changes);
    }

    /// Reads files into changes for the store, never waiting on one file for long: a file
    /// whose read has not finished after a while (a hung filesystem) is reported as such and
    /// the rest are read on another thread.
    async fn read_files(&self, paths: Vec<PathBuf>, occasion: Occasion) -> Read {
        let mut changes = Vec::with_capacity(paths.len());
        let mut signatures = BTreeMap::new();
        let mut rest = std::collections::VecDeque::from(paths);
        while !rest.is_empty() {
            let (tx, mut rx) = mpsc::unbounded_channel();
            let todo: Vec<PathBuf> = rest.iter().cloned().collect();
            let limits = self.limits;
            let (reads, held) = (self.reads.clone(), self.held.clone());
            tokio::task::spawn_blocking(move || {
                for path in todo {
                    // Before the read: a change after it shows as a change at the next look.
                    let signature = Signature::of(&path);
                    // A held file that changed since is read as at a close: held again if
                    // it is still empty (another writer truncated it meanwhile).
                    let occasion = match occasion {
                        Occasion::Quiet
                            if crate::sync::lock(&held).get(&path).map(|h| h.0)
                                != Some(signature) =>
                        {
                            Occasion::Written
                        }
                        occasion => occasion,
                    };
                    reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let read = read_file(&path, limits, occasion);
                    if tx.send((path.clone(), signature, occasion, read)).is_err() {
                        return;
                    }
                }
            });
            loop {
                match tokio::time::timeout(READ_STALL, rx.recv()).await {
                    Ok(Some((path, signature, occasion, (read, transient)))) => {
                        rest.pop_front();
                        self.note_retry(&path, transient);
                        self.note_held(&path, signature, occasion, read.is_empty());
                        // A file not read (empty, being written) is looked at again by the
                        // next listing, and read at its writer's close.
                        if !read.is_empty() {
                            signatures.insert(path, signature);
                        }
                        changes.extend(read);
                    }
                    Ok(None) => break,
                    Err(_) => {
                        let Some(path) = rest.pop_front() else { break };
                        let err = manifest_error(
                            &path,
                            None,
                            None,
                            format!("reading it has not finished after {READ_STALL:?} (is its filesystem hung?); other files carry on, and it is read again on its next change"),
                        );
                        changes.push(Change::File {
                            path,
                            content: FileContent::Broken(vec![err]),
                        });
                        break;
                    }
                }
            }
        }
        (changes, signatures)
    }

    /// Schedules `path` to be read again with backoff (its read failed for a passing reason), or
    /// forgets it.
    fn note_retry(&self, path: &Path, transient: bool) {
        use kubevol_core::backoff::{Backoff, BackoffPolicy};
        let mut retries = crate::sync::lock(&self.retries);
        if transient {
            let prev = retries.get(path).copied();
            let b = Backoff::fail(prev, BackoffPolicy::RECONNECT, std::time::Instant::now());
            retries.insert(path.to_path_buf(), b);
        } else {
            retries.remove(path);
        }
    }

    /// Holds `path` back for [`ManifestSource::with_empty_quiet`] when a read at its writer's
    /// close found it empty (`unread`), and forgets it once a read delivered it.
    fn note_held(
        &self,
        path: &Path,
        signature: Option<Signature>,
        occasion: Occasion,
        unread: bool,
    ) {
        let mut held = crate::sync::lock(&self.held);
        if unread && occasion == Occasion::Written {
            debug!(file = %path.display(), quiet = ?self.empty_quiet, "manifest empty at its writer's close: held until its next writer's close, or applied once unchanged this long");
            let due = tokio::time::Instant::now() + self.empty_quiet;
            held.insert(path.to_path_buf(), (signature, due));
            self.holds
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        } else if !unread {
            held.remove(path);
        }
    }

    /// The files held empty long enough to be read again now.
    fn due_held(&self) -> Vec<PathBuf> {
        let now = tokio::time::Instant::now();
        crate::sync::lock(&self.held)
            .iter()
            .filter(|(_, (_, due))| *due <= now)
            .map(|(p, _)| p.clone())
            .collect()
    }

    /// The files due to be read again now.
    fn due_retries(&self) -> Vec<PathBuf> {
        let now = std::time::Instant::now();
        crate::sync::lock(&self.retries)
            .iter()
            .filter(|(_, b)| b.is_ready(now))
            .map(|(p, _)| p.clone())
            .collect()
    }

    /// Lists the directory and reads its manifest files (with `all`, every one; otherwise only
    /// those `stat` shows changed since they were read), and forgets files that are gone: at
    /// once (`switched`: every file of a directory the path no longer leads to, in the same
    /// change of the store as the new directory's), or once confirmed.
    async fn load_all(&self, sink: &Sink, all: bool, switched: bool) -> std::io::Result<()> {
        let dir = self.dir.clone();
        let listed = tokio::task::spawn_blocking(
            move || -> std::io::Result<BTreeMap<PathBuf, Option<Signature>>> {
                let mut present = BTreeMap::new();
                for entry in std::fs::read_dir(&dir)? {
                    let path = entry?.path();
                    if is_manifest_file(&path) {
                        let signature = (!all).then(|| Signature::of(&path)).flatten();
                        present.insert(path, signature);
                    }
                }
                Ok(present)
            },
        )
        .await
        .map_err(std::io::Error::other)??;
        let (todo, gone) = {
            let delivered = crate::sync::lock(&self.delivered);
            let todo: Vec<PathBuf> = listed
                .iter()
                .filter(|(path, now)| {
                    all || now.is_none() || delivered.get(*path).is_none_or(|then| then != *now)
                })
                .map(|(path, _)| path.clone())
                .collect();
            let gone: Vec<PathBuf> = delivered
                .keys()
                .filter(|known| !listed.contains_key(*known))
                .cloned()
                .collect();
            (todo, gone)
        };
        let (mut changes, read) = self.read_files(todo, Occasion::Listed).await;
        changes.extend(gone.into_iter().map(|path| Change::File {
            path,
            content: FileContent::Gone,
        }));
        if switched {
            self.apply(sink, (changes, read));
        } else {
            self.deliver(sink, (changes, read));
        }
        Ok(())
    }

    /// Starts watching the directory, reads it once completely, marks the source synced, and
    /// returns the task that then applies every change as inotify reports it, until it is
    /// dropped or aborted. The events that arrive together are applied together: a rename (the
    /// old name gone, the new one there) never shows the store a moment without the pods it
    /// moved. The given path is resolved again when an entry on the way to it changes: a
    /// directory replaced, moved or re-pointed is listed anew, and one that is gone is reported
    /// while nothing is torn down. Fails if the directory cannot be watched or listed now.
    pub async fn listen(mut self, sink: Sink) -> std::io::Result<tokio::task::JoinHandle<()>> {
        // The way first: a change on it between the two is seen.
        let way = Way::watch(way_of(&self.given));
        let resolved = Resolved::of(&self.given)?;
        self.dir = resolved.path.clone();
        // Watch before the first listing, so no change between the two is lost.
        let watch = Watch::start(resolved)?;
        self.load_all(&sink, true, false).await?;
        sink.problem(None);
        sink.synced();
        info!(dir = %self.dir.display(), "manifest directory listed");
        Ok(tokio::spawn(self.follow(sink, watch, way)))
    }

    /// When the loop has something to do without an event: the next listing, the first held
    /// back removal to confirm, the first file to read again, or the first empty file held
    /// long enough.
    fn next_due(&self, next_relist: tokio::time::Instant) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        let removal = crate::sync::lock(&self.removals)
            .values()
            .min()
            .map(|at| *at + REMOVAL_SETTLE);
        let retry = crate::sync::lock(&self.retries)
            .values()
            .map(|b| b.ready_at())
            .min()
            .map(|at| now + at.saturating_duration_since(std::time::Instant::now()));
        let held = crate::sync::lock(&self.held).values().map(|h| h.1).min();
        // A resolution still running when one was due is tried again shortly, not at once.
        let soonest = now + Duration::from_millis(50);
        [removal, retry, held]
            .into_iter()
            .flatten()
            .map(|due| due.max(soonest))
            .fold(next_relist, tokio::time::Instant::min)
    }

    /// Applies the directory's changes until aborted (see [`ManifestSource::listen`]).
    async fn follow(mut self, sink: Sink, watch: Watch, mut way: Way) {
        let mut watch = Some(watch);
        let mut next_relist = tokio::time::Instant::now() + RELIST_PERIOD;
        loop {
            let due = self.next_due(next_relist);
            let batch = tokio::select! {
                first = Watch::next(&mut watch) => Some(first),
                () = way.changed() => None,
                () = tokio::time::sleep_until(due) => None,
            };
            // Events that ask for no read (kubevol's own opens and closes among them) cost no
            // resolution: a change of the way wakes one.
            let batch = match batch {
                Some(Some(first)) => match self.collect_events(&mut watch, first).await {
                    Some(work) => Some(Some(work)),
                    None => continue,
                },
                Some(None) => Some(None),
                None => None,
            };
            // Events are only ever taken for the directory the path still leads to: the old
            // directory of a replaced one keeps sending them.
            let (now, entries) = match self.resolve().await {
                Some(now) => now,
                // Still resolving (a hung filesystem): nothing is known, nothing changes.
                None => continue,
            };
            if let Some(entries) = entries.filter(|e| !way.is(e)) {
                way = Way::watch(entries);
            }
            let same = matches!((&now, &watch), (Ok(r), Some(w)) if *r == w.resolved);
            if !same {
                // The files of a directory that went or was replaced are not removals.
                crate::sync::lock(&self.removals).clear();
                crate::sync::lock(&self.held).clear();
                watch = self.switch(&sink, now, watch.take()).await;
                next_relist = tokio::time::Instant::now() + RELIST_PERIOD;
                continue;
            }
            self.confirm_removals(&sink);
            match batch {
                Some(Some((paths, rescan))) => self.apply_events(&sink, paths, rescan).await,
                // The watch ended: it is made again at the next resolution.
                Some(None) => watch = None,
                None if tokio::time::Instant::now() >= next_relist => {
                    next_relist = tokio::time::Instant::now() + RELIST_PERIOD;
                    self.relist(&sink, false).await;
                }
                None => {
                    let due = self.due_retries();
                    if !due.is_empty() {
                        let read = self.read_files(due, Occasion::Listed).await;
                        self.deliver(&sink, read);
                    }
                    let quiet = self.due_held();
                    if !quiet.is_empty() {
                        let read = self.read_files(quiet, Occasion::Quiet).await;
                        self.deliver(&sink, read);
                    }
                }
            }
        }
    }

    /// Where the given path leads now, resolved on a blocking thread, and the way there (see
    /// [`way_of`]): `None` while an earlier resolution has not finished, or this one does not
    /// within [`READ_STALL`] (its filesystem hangs), which is reported as a problem of the source.
    /// The way is `None` when it is not known (the resolution failed to run or hangs).
    async fn resolve(&self) -> Option<(std::io::Result<Resolved>, Option<BTreeSet<PathBuf>>)> {
        use std::sync::atomic::Ordering;
        if self.resolving.swap(true, Ordering::AcqRel) {
            return None;
        }
        let (given, resolving) = (self.given.clone(), self.resolving.clone());
        let task = tokio::task::spawn_blocking(move || {
            // The way first: a change of it between the two wakes another resolution.
            let way = way_of(&given);
            let r = Resolved::of(&given);
            resolving.store(false, Ordering::Release);
            (r, way)
        });
        match tokio::time::timeout(READ_STALL, task).await {
            Ok(Ok((r, way))) => Some((r, Some(way))),
            Ok(Err(e)) => Some((Err(std::io::Error::other(e)), None)),
            Err(_) => Some((
                Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "resolving it has not finished after {READ_STALL:?} (is its filesystem hung?)"
                    ),
                )),
                None,
            )),
        }
    }

    /// What a batch of events (starting with `first`) says changed: the files to read, and
    /// whether the whole directory is to be listed again; `None` if nothing.
    async fn collect_events(
        &self,
        watch: &mut Option<Watch>,
        first: notify::Result<notify::Event>,
    ) -> Option<(BTreeSet<PathBuf>, bool)> {
        let w = watch.as_mut()?;
        let mut batch = vec![first];
        while let Ok(more) = w.rx.try_recv() {
            batch.push(more);
        }
        // The two halves of a rename are reported one after the other: applying the old
        // name's removal without the new name would take the pod away.
        while unpaired_rename(&batch) {
            match tokio::time::timeout(RENAME_PAIR_WAIT, w.rx.recv()).await {
                Ok(Some(more)) => batch.push(more),
                // Moved out of the directory (or the watch ended): a removal.
                Ok(None) | Err(_) => break,
            }
        }
        let mut paths = BTreeSet::new();
        let mut rescan = false;
        for ev in batch {
            match ev {
                Ok(ev) if ev.need_rescan() => rescan = true,
                Ok(ev) if settles_file(&ev.kind) => {
                    paths.extend(ev.paths.into_iter().filter(|p| is_manifest_file(p)))
                }
                // Opens (kubevol's own reads among them) and writes in progress.
                Ok(_) => {}
                Err(e) => {
                    warn!(dir = %self.dir.display(), "watch error, re-reading the directory: {e}");
                    rescan = true;
                }
            }
        }
        (rescan || !paths.is_empty()).then_some((paths, rescan))
    }

    /// Reads what [`ManifestSource::collect_events`] found changed.
    async fn apply_events(&self, sink: &Sink, paths: BTreeSet<PathBuf>, rescan: bool) {
        if rescan {
            self.relist(sink, true).await;
        } else if !paths.is_empty() {
            let read = self
                .read_files(paths.into_iter().collect(), Occasion::Written)
                .await;
            self.deliver(sink, read);
        }
    }

    /// Lists the directory again (every file, or those that changed), reporting a failure as a
    /// problem of the source.
    async fn relist(&self, sink: &Sink, all: bool) {
        match self.load_all(sink, all, false).await {
            Ok(()) => sink.problem(None),
            Err(e) => {
                warn!(dir = %self.dir.display(), "cannot list manifest directory: {e}");
                sink.problem(Some(format!(
                    "manifest directory {}: cannot list it: {e}",
                    self.dir.display()
                )));
            }
        }
    }

    /// The given path leads elsewhere now (`now`), or nowhere: watches and lists the new
    /// directory once it is quiet, taking the old one's files away in the same change; or, with
    /// no directory, reports it and changes nothing, so nothing is torn down until it is back.
    async fn switch(
        &mut self,
        sink: &Sink,
        now: std::io::Result<Resolved>,
        old: Option<Watch>,
    ) -> Option<Watch> {
        let given = self.given.display();
        let was = old.as_ref().map(|w| w.resolved.path.clone());
        drop(old);
        let failed = |e: std::io::Error| {
            let problem = if e.kind() == std::io::ErrorKind::NotFound {
                format!("manifest directory {given} is gone; nothing is torn down until it is back")
            } else {
                format!("manifest directory {given}: cannot read it ({e}); nothing is torn down until it can be read")
            };
            if was.is_some() {
                warn!("{problem}");
            }
            sink.problem(Some(problem));
            None
        };
        let resolved = match now {
            Ok(r) => r,
            Err(e) => return failed(e),
        };
        let watch = match Watch::start(resolved.clone()) {
            Ok(w) => w.quiet().await,
            Err(e) => return failed(e),
        };
        info!(dir = %given, leads_to = %resolved.path.display(), was = ?was, "manifest directory replaced, moved or re-pointed; listing it");
        self.dir = resolved.path;
        match self.load_all(sink, true, true).await {
            Ok(()) => {
                sink.problem(None);
                Some(watch)
            }
            Err(e) => failed(e),
        }
    }
}

/// An inotify watch of the directory a path led to, and its events.
struct Watch {
    resolved: Resolved,
    rx: mpsc::UnboundedReceiver<notify::Result<notify::Event>>,
    _watcher: notify::RecommendedWatcher,
}

impl Watch {
    fn start(resolved: Resolved) -> std::io::Result<Watch> {
        let (tx, rx) = mpsc::unbounded_channel::<notify::Result<notify::Event>>();
        let mut watcher = notify::recommended_watcher(move |ev| {
            let _ = tx.send(ev);
        })
        .map_err(std::io::Error::other)?;
        watcher
            .watch(&resolved.path, notify::RecursiveMode::NonRecursive)
            .map_err(std::io::Error::other)?;
        Ok(Watch {
            resolved,
            rx,
            _watcher: watcher,
        })
    }

    /// The next event of the watch, if there is one (never, without a watch).
    async fn next(watch: &mut Option<Watch>) -> Option<notify::Result<notify::Event>> {
        match watch {
            Some(w) => w.rx.recv().await,
            None => std::future::pending().await,
        }
    }

    /// Waits until no event has come for [`SWITCH_QUIET`] (at most [`SWITCH_QUIET_MAX`]): a
    /// directory being filled is listed once filled.
    async fn quiet(mut self) -> Watch {
        let until = tokio::time::Instant::now() + SWITCH_QUIET_MAX;
        while tokio::time::Instant::now() < until {
            match tokio::time::timeout(SWITCH_QUIET, self.rx.recv()).await {
                Ok(Some(_)) => while self.rx.try_recv().is_ok() {},
                Ok(None) | Err(_) => break,
            }
        }
        self
    }
}

/// As a pod source, the directory is listened to for good: while it is missing or unreadable
/// the source retries with backoff (500 ms doubling to 30 s) and stays unsynced, so nothing is
/// torn down meanwhile.
impl PodSource for ManifestSource {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn start(self: Box<Self>, sink: Sink) -> BoxFuture<()> {
        Box::pin(async move {
            /// Aborts the watch when the task that owns it is aborted.
            struct AbortOnDrop(tokio::task::JoinHandle<()>);
            impl Drop for AbortOnDrop {
                fn drop(&mut self) {
                    self.0.abort();
                }
            }
            for delay in kubevol_core::backoff::BackoffPolicy::RECONNECT.delays() {
                match (*self).clone().listen(sink.clone()).await {
                    Ok(watch) => {
                        let mut watch = AbortOnDrop(watch);
                        let _ = (&mut watch.0).await;
                        return;
                    }
                    Err(e) => {
                        warn!(dir = %self.dir.display(), retry_in = ?delay, "cannot read the manifest directory: {e}; nothing is torn down until it is listed");
                        sink.problem(Some(format!(
                            "manifest directory {}: cannot read it ({e}); tried again every {delay:?} at most",
                            self.dir.display()
                        )));
                        tokio::time::sleep(delay).await;
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_settled_files_are_read() {
        use notify::event::{
            AccessKind, AccessMode, CreateKind, DataChange, EventKind, ModifyKind, RemoveKind,
            RenameMode,
        };
        assert!(settles_file(&EventKind::Access(AccessKind::Close(
            AccessMode::Write
        ))));
        assert!(settles_file(&EventKind::Create(CreateKind::File)));
        assert!(settles_file(&EventKind::Remove(RemoveKind::File)));
        assert!(settles_file(&EventKind::Modify(ModifyKind::Name(
            RenameMode::To
        ))));
        assert!(settles_file(&EventKind::Modify(ModifyKind::Name(
            RenameMode::From
        ))));
        assert!(
            !settles_file(&EventKind::Modify(ModifyKind::Name(RenameMode::Both))),
            "the pairing of a rename's halves, each reported on its own"
        );
        assert!(
            !settles_file(&EventKind::Modify(ModifyKind::Data(DataChange::Any))),
            "a write in progress"
        );
        assert!(!settles_file(&EventKind::Access(AccessKind::Open(
            AccessMode::Any
        ))));
    }

    #[test]
    fn manifest_extensions() {
        assert!(is_manifest_file(Path::new("/d/a.yaml")));
        assert!(is_manifest_file(Path::new("/d/a.yml")));
        assert!(is_manifest_file(Path::new("/d/a.json")));
        assert!(!is_manifest_file(Path::new("/d/a.yaml.swp")));
        assert!(!is_manifest_file(Path::new("/d/.a.yaml")));
        assert!(!is_manifest_file(Path::new("/d/README.md")));
    }
}
