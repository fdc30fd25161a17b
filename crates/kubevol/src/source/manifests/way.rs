//! The way to the manifest directory: every directory entry a resolution of the given path
//! looks up (each component, and each component of every symbolic link followed), watched with
//! inotify in the directories that hold them. A change of any of them (a directory replaced or
//! moved, a link re-pointed, the directory appearing) wakes a resolution at once, so nothing
//! polls the path while nothing changes.

use std::collections::{BTreeSet, VecDeque};
use std::ffi::OsString;
use std::path::{Component, Path, PathBuf};

use notify::Watcher;
use tokio::sync::mpsc;

/// The most symbolic links a resolution follows (the kernel's limit, ELOOP beyond).
const MAX_LINKS: usize = 40;

/// The entries (absolute paths, not resolved) that resolving `given` looks up, in order of
/// lookup, up to the first that is missing or cannot be read (the one whose appearance would
/// change the answer). Symbolic links are followed as the kernel does, at most [`MAX_LINKS`].
pub(super) fn way_of(given: &Path) -> BTreeSet<PathBuf> {
    let mut entries = BTreeSet::new();
    let mut at = if given.is_absolute() {
        PathBuf::from("/")
    } else {
        std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"))
    };
    let mut todo: VecDeque<OsString> = VecDeque::new();
    push_front(&mut todo, given);
    let mut links = 0;
    while let Some(name) = todo.pop_front() {
        if name == ".." {
            at.pop();
            continue;
        }
        let next = at.join(&name);
        entries.insert(next.clone());
        match std::fs::symlink_metadata(&next) {
            Ok(m) if m.file_type().is_symlink() => {
                links += 1;
                let Ok(target) = std::fs::read_link(&next) else {
                    break;
                };
                if links > MAX_LINKS {
                    break;
                }
                if target.is_absolute() {
                    at = PathBuf::from("/");
                }
                push_front(&mut todo, &target);
            }
            Ok(_) => at = next,
            Err(_) => break,
        }
    }
    entries
}

/// Puts the components of `path` (names and `..`; the root and `.` say nothing) before those
/// still to look up.
fn push_front(todo: &mut VecDeque<OsString>, path: &Path) {
    for c in path.components().rev() {
        match c {
            Component::Normal(name) => todo.push_front(name.to_os_string()),
            Component::ParentDir => todo.push_front(OsString::from("..")),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
}

/// Whether an event changes what an entry is: made, removed or renamed (over). Opens, reads
/// and writes of the entries (kubevol's own listing of the directory among them) do not.
fn changes_entry(kind: &notify::EventKind) -> bool {
    use notify::event::{EventKind, ModifyKind};
    matches!(
        kind,
        EventKind::Create(_) | EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(_))
    )
}

/// The watches of the directories that hold the way's entries, and the wake-ups they send.
pub(super) struct Way {
    entries: BTreeSet<PathBuf>,
    woken: mpsc::UnboundedReceiver<()>,
    _watcher: Option<notify::RecommendedWatcher>,
}

impl Way {
    /// Watches the directories holding `entries`. A directory that cannot be watched (no
    /// permission, inotify's limit reached) is left to the periodic resolution.
    pub(super) fn watch(entries: BTreeSet<PathBuf>) -> Way {
        let (tx, woken) = mpsc::unbounded_channel();
        let wanted = entries.clone();
        let watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
            let ours = match &ev {
                Ok(ev) => {
                    ev.need_rescan()
                        || (changes_entry(&ev.kind) && ev.paths.iter().any(|p| wanted.contains(p)))
                }
                // An error of the watch: the resolution tells what is true now.
                Err(_) => true,
            };
            if ours {
                let _ = tx.send(());
            }
        });
        let watcher = watcher.ok().map(|mut w| {
            let holders: BTreeSet<&Path> = entries.iter().filter_map(|e| e.parent()).collect();
            for dir in holders {
                let _ = w.watch(dir, notify::RecursiveMode::NonRecursive);
            }
            w
        });
        Way {
            entries,
            woken,
            _watcher: watcher,
        }
    }

    /// Whether the way is still `entries` (a resolution found the same one).
    pub(super) fn is(&self, entries: &BTreeSet<PathBuf>) -> bool {
        self.entries == *entries
    }

    /// Resolves when an entry of the way changed (several changes at once wake it once).
    pub(super) async fn changed(&mut self) {
        if self.woken.recv().await.is_none() {
            return std::future::pending().await;
        }
        while self.woken.try_recv().is_ok() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn set(paths: &[PathBuf]) -> BTreeSet<PathBuf> {
        paths.iter().cloned().collect()
    }

    #[test]
    fn the_way_goes_through_every_link_and_stops_at_the_first_missing_entry() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().canonicalize().unwrap();
        std::fs::create_dir_all(root.join("releases/r2")).unwrap();
        symlink("releases/r2", root.join("current")).unwrap();
        symlink(root.join("current"), root.join("manifests")).unwrap();
        let way = way_of(&root.join("manifests"));
        for entry in [
            root.join("manifests"),
            root.join("current"),
            root.join("releases"),
            root.join("releases/r2"),
        ] {
            assert!(way.contains(&entry), "{} is on the way", entry.display());
        }
        // Every ancestor of the root is on the way too (a parent replaced changes the answer).
        assert!(way.contains(&root));
        let missing = way_of(&root.join("absent/deeper"));
        assert!(missing.contains(&root.join("absent")));
        assert!(
            !missing.contains(&root.join("absent/deeper")),
            "nothing below a missing entry is looked up"
        );
    }

    #[test]
    fn a_loop_of_links_ends() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().canonicalize().unwrap();
        symlink("b", root.join("a")).unwrap();
        symlink("a", root.join("b")).unwrap();
        let way = way_of(&root.join("a/x"));
        assert!(way.is_superset(&set(&[root.join("a"), root.join("b")])));
        assert!(!way.contains(&root.join("x")));
    }

    #[test]
    fn dot_dot_leaves_the_directory_a_link_led_to() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().canonicalize().unwrap();
        std::fs::create_dir_all(root.join("d/inner")).unwrap();
        std::fs::create_dir_all(root.join("m")).unwrap();
        symlink(root.join("d/inner"), root.join("l")).unwrap();
        let way = way_of(&root.join("l/../../m"));
        assert!(way.contains(&root.join("d/inner")));
        assert!(
            way.contains(&root.join("m")),
            "l/.. is d, and d/.. the root"
        );
    }
}
