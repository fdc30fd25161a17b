//! The manifest-directory source: every `*.yaml`, `*.yml` and `*.json` file of a directory,
//! multi-document, parsed into Kubernetes objects, and watched with inotify so that adding,
//! changing or removing a file updates the store within one event.
//!
//! A file with an error (it does not parse, or a document is not a valid object) is reported with
//! its path, document, line and column and is not applied: the objects it delivered before stay
//! in place, so a half-saved edit never unmounts a running pod. Other files are unaffected.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use notify::Watcher;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{BoxFuture, PodSource, Sink};
use crate::store::{Change, FileContent};
use parse::manifest_error;

mod locate;
mod parse;
mod read;

pub use parse::{humanize, parse_manifest};
pub use read::{read_file, DEFAULT_MAX_FILE_SIZE};

/// Whether a file name is a manifest kubevol reads.
pub fn is_manifest_file(path: &Path) -> bool {
    let hidden = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_none_or(|n| n.starts_with('.'));
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    !hidden && matches!(ext, "yaml" | "yml" | "json")
}

/// Whether an inotify event leaves a file in a state worth reading: the writer closed it, or it
/// appeared, moved or went away. A plain modification is not: `write(2)` after `O_TRUNC` shows
/// an empty or half-written file, and reading it then would take its pods away.
pub fn settles_file(kind: &notify::EventKind) -> bool {
    use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind};
    matches!(
        kind,
        EventKind::Access(AccessKind::Close(AccessMode::Write))
            | EventKind::Create(_)
            | EventKind::Remove(_)
            | EventKind::Modify(ModifyKind::Name(_))
    )
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

/// The manifest-directory source.
#[derive(Clone)]
pub struct ManifestSource {
    dir: PathBuf,
    max_file_size: u64,
    /// The files this source has delivered (objects or errors), so that a re-listing can tell
    /// the store which are gone.
    delivered: Arc<Mutex<BTreeSet<PathBuf>>>,
}

impl ManifestSource {
    /// The source's name in the store's sync gate.
    pub const NAME: &'static str = "file";

    /// A source for `dir`. Nothing is read until it is started.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        ManifestSource {
            dir: dir.into(),
            max_file_size: DEFAULT_MAX_FILE_SIZE,
            delivered: Arc::default(),
        }
    }

    /// Sets the largest file read (bigger files are reported, not read).
    pub fn with_max_file_size(mut self, bytes: u64) -> Self {
        self.max_file_size = bytes;
        self
    }

    /// The directory read.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Applies changes read from files, remembering which files this source has delivered.
    fn deliver(&self, sink: &Sink, changes: Vec<Change>) {
        {
            let mut delivered = crate::sync::lock(&self.delivered);
            for c in &changes {
                if let Change::File { path, content } = c {
                    match content {
                        FileContent::Gone => delivered.remove(path),
                        _ => delivered.insert(path.clone()),
                    };
                }
            }
        }
        sink.apply(changes);
    }

    /// Reads files into changes for the store, never waiting on one file for long: a file
    /// whose read has not finished after a while (a hung filesystem) is reported as such and
    /// the rest are read on another thread.
    async fn read_files(&self, paths: Vec<PathBuf>) -> Vec<Change> {
        let mut changes = Vec::with_capacity(paths.len());
        let mut rest = std::collections::VecDeque::from(paths);
        while !rest.is_empty() {
            let (tx, mut rx) = mpsc::unbounded_channel();
            let todo: Vec<PathBuf> = rest.iter().cloned().collect();
            let max = self.max_file_size;
            tokio::task::spawn_blocking(move || {
                for path in todo {
                    if tx.send(read_file(&path, max)).is_err() {
                        return;
                    }
                }
            });
            loop {
                match tokio::time::timeout(READ_STALL, rx.recv()).await {
                    Ok(Some(read)) => {
                        rest.pop_front();
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
                        warn!("{err}");
                        changes.push(Change::File {
                            path,
                            content: FileContent::Broken(vec![err]),
                        });
                        break;
                    }
                }
            }
        }
        changes
    }

    /// Reads every manifest file, and forgets files that are gone, as one change of the store.
    async fn load_all(&self, sink: &Sink) -> std::io::Result<()> {
        let dir = self.dir.clone();
        let listed = tokio::task::spawn_blocking(move || -> std::io::Result<BTreeSet<PathBuf>> {
            let mut present = BTreeSet::new();
            for entry in std::fs::read_dir(&dir)? {
                let path = entry?.path();
                if is_manifest_file(&path) {
                    present.insert(path);
                }
            }
            Ok(present)
        })
        .await
        .map_err(std::io::Error::other)??;
        let mut changes = self.read_files(listed.iter().cloned().collect()).await;
        let gone: Vec<PathBuf> = crate::sync::lock(&self.delivered)
            .iter()
            .filter(|known| !listed.contains(*known))
            .cloned()
            .collect();
        changes.extend(gone.into_iter().map(|path| Change::File {
            path,
            content: FileContent::Gone,
        }));
        self.deliver(sink, changes);
        Ok(())
    }

    /// Starts watching the directory, reads it once completely, marks the source synced, and
    /// returns the task that then applies every change as inotify reports it, until it is
    /// dropped or aborted. The events that arrive together are applied together: a rename (the
    /// old name gone, the new one there) never shows the store a moment without the pods it
    /// moved. Fails if the directory cannot be watched or listed.
    pub async fn listen(mut self, sink: Sink) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let dir = std::fs::canonicalize(&self.dir)?;
        if !dir.is_dir() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotADirectory,
                format!("{} is not a directory", dir.display()),
            ));
        }
        self.dir = dir;
        let (tx, mut rx) = mpsc::unbounded_channel::<notify::Result<notify::Event>>();
        let mut watcher = notify::recommended_watcher(move |ev| {
            let _ = tx.send(ev);
        })
        .map_err(std::io::Error::other)?;
        // Watch before the first listing, so no change between the two is lost.
        watcher
            .watch(&self.dir, notify::RecursiveMode::NonRecursive)
            .map_err(std::io::Error::other)?;
        self.load_all(&sink).await?;
        sink.problem(None);
        sink.synced();
        info!(dir = %self.dir.display(), "manifest directory listed");
        Ok(tokio::spawn(async move {
            let _watcher = watcher;
            while let Some(first) = rx.recv().await {
                let mut batch = vec![first];
                while let Ok(more) = rx.try_recv() {
                    batch.push(more);
                }
                // The two halves of a rename are reported one after the other: applying the
                // old name's removal without the new name would take the pod away.
                while unpaired_rename(&batch) {
                    match tokio::time::timeout(RENAME_PAIR_WAIT, rx.recv()).await {
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
                if rescan {
                    match self.load_all(&sink).await {
                        Ok(()) => sink.problem(None),
                        Err(e) => {
                            warn!(dir = %self.dir.display(), "cannot list manifest directory: {e}");
                            sink.problem(Some(format!(
                                "manifest directory {}: cannot list it: {e}",
                                self.dir.display()
                            )));
                        }
                    }
                } else if !paths.is_empty() {
                    let changes = self.read_files(paths.into_iter().collect()).await;
                    self.deliver(&sink, changes);
                }
            }
        }))
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
