//! Reading one manifest file safely: only a regular file, never blocking, never more than a
//! size limit.

use std::path::Path;

use tracing::debug;

use super::parse::{manifest_error, parse_file};
use crate::store::{Change, FileContent, ObjectName};

/// The largest manifest file read by default (8 MiB; the API server's own request limit is
/// 3 MiB, so no real manifest comes near it).
pub const DEFAULT_MAX_FILE_SIZE: u64 = 8 << 20;

/// What a file that is not a regular file is, in words.
fn file_type_name(mode: rustix::fs::FileType) -> &'static str {
    use rustix::fs::FileType;
    match mode {
        FileType::Directory => "a directory",
        FileType::Fifo => "a FIFO (named pipe)",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Socket => "a socket",
        FileType::Symlink => "a symbolic link",
        FileType::RegularFile => "a regular file",
        FileType::Unknown => "of an unknown type",
    }
}

/// How a file came to be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Occasion {
    /// Its writer is done: it was closed after a write, created, or renamed into place. By the
    /// time the event is read, another writer may have truncated it again.
    Written,
    /// A listing (or a retry) found it changed, whoever may be writing it now.
    Listed,
    /// It was found empty at its writer's close and has stayed the same since, for a while:
    /// its writer left it empty.
    Quiet,
}

/// Reads one manifest file as the store takes it: its objects (and the names of those of kinds
/// kubevol does not run), its errors, or that it is gone; and whether the read failed for a
/// reason that passes by itself (too many open files, an I/O error), so that it is tried again.
///
/// An empty file is applied (it defines nothing) only on [`Occasion::Quiet`]; on the other
/// occasions it gives no change. It may be a file between a writer's truncation and its writes
/// (`O_TRUNC`, then `write`): a listing can find it so, and so can the close event of the
/// writer before, read after the next writer's `O_TRUNC`. Taken as "no objects" it would take
/// its pods away, and their volumes with them, until the writer's close reads it again. The
/// watch reads an empty file its writer closed again once it has stayed unchanged for a while
/// (`Quiet`).
pub fn read_file(path: &Path, limits: ReadLimits, occasion: Occasion) -> (Vec<Change>, bool) {
    let Some((content, skipped, transient)) = read_content(path, limits, occasion) else {
        return (Vec::new(), false);
    };
    let mut changes = vec![Change::File {
        path: path.to_path_buf(),
        content,
    }];
    if let Some((objects, warnings)) = skipped {
        changes.push(Change::Skipped {
            path: path.to_path_buf(),
            objects,
        });
        changes.push(Change::Warnings {
            path: path.to_path_buf(),
            warnings,
        });
    }
    (changes, transient)
}

/// Whether a failed open or read may succeed when simply tried again.
pub fn is_transient(errno: rustix::io::Errno) -> bool {
    use rustix::io::Errno;
    matches!(
        errno,
        Errno::MFILE | Errno::NFILE | Errno::NOMEM | Errno::IO | Errno::INTR | Errno::NOBUFS
    )
}

/// What reading a file gave: its content, the objects of kinds kubevol does not run and the
/// fields its objects set that the types do not have, and whether a failure is transient.
type Content = (
    FileContent,
    Option<(Vec<ObjectName>, Vec<crate::store::ManifestError>)>,
    bool,
);

/// How files are read.
#[derive(Clone, Copy, Debug)]
pub struct ReadLimits {
    /// The largest file read (bigger ones are reported, not read).
    pub max_size: u64,
    /// Follow symbolic links wherever they lead. Off, a link is followed only while it stays
    /// beneath the manifest directory (a relative link to a file in it or below it, as a
    /// ConfigMap's volume links `x.yaml` to `..data/x.yaml`): kubevol reads as root, and a link
    /// written by one of the directory's writers must not read a file that writer may not.
    pub follow_links: bool,
}

impl Default for ReadLimits {
    fn default() -> Self {
        ReadLimits {
            max_size: DEFAULT_MAX_FILE_SIZE,
            follow_links: false,
        }
    }
}

/// Why a file was not opened.
enum Unopened {
    /// Not a regular file (after following links).
    Kind(rustix::fs::FileType),
    /// A link out of the manifest directory, not followed.
    LeadsOut,
}

/// Opens `path` (a file of the manifest directory) with `O_PATH`: links followed wherever they
/// lead with `follow_links`, else only beneath the directory (`RESOLVE_BENEATH`: a link that
/// leaves it, an absolute link among them, is refused by the kernel, with no window between a
/// check and the open). Where the kernel has no openat2, a link is not followed at all.
fn open_path(
    path: &Path,
    follow_links: bool,
) -> Result<Result<std::os::fd::OwnedFd, Unopened>, rustix::io::Errno> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let flags = OFlags::PATH | OFlags::CLOEXEC;
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return rustix::fs::open(path, flags, Mode::empty()).map(Ok);
    };
    if follow_links {
        return rustix::fs::open(path, flags, Mode::empty()).map(Ok);
    }
    let dir = rustix::fs::open(
        dir,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let beneath = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
    match rustix::fs::openat2(&dir, name, flags, Mode::empty(), beneath) {
        Ok(fd) => Ok(Ok(fd)),
        Err(rustix::io::Errno::XDEV) => Ok(Err(Unopened::LeadsOut)),
        Err(rustix::io::Errno::NOSYS) => {
            match rustix::fs::openat(&dir, name, flags | OFlags::NOFOLLOW, Mode::empty()) {
                Ok(fd)
                    if rustix::fs::FileType::from_raw_mode(rustix::fs::fstat(&fd)?.st_mode)
                        == rustix::fs::FileType::Symlink =>
                {
                    Ok(Err(Unopened::LeadsOut))
                }
                r => r.map(Ok),
            }
        }
        Err(e) => Err(e),
    }
}

/// Opens `path` for reading only once it is known to be a regular file: it is first opened
/// with `O_PATH` ([`open_path`]; an `O_PATH` open has no side effect on a device, a FIFO or a
/// socket), its type read from that descriptor, and only a regular file is opened again, for
/// reading, through that very descriptor (`/proc/self/fd`), so nothing can be swapped in
/// between. Where `/proc` is not mounted, the path is opened non-blocking and checked to be
/// the same file.
fn open_regular(
    path: &Path,
    follow_links: bool,
) -> Result<Result<std::os::fd::OwnedFd, Unopened>, rustix::io::Errno> {
    use rustix::fs::{FileType, Mode, OFlags};
    let pinned = match open_path(path, follow_links)? {
        Ok(fd) => fd,
        Err(why) => return Ok(Err(why)),
    };
    let st = rustix::fs::fstat(&pinned)?;
    let kind = FileType::from_raw_mode(st.st_mode);
    if kind != FileType::RegularFile {
        return Ok(Err(Unopened::Kind(kind)));
    }
    let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY;
    let through = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&pinned));
    match rustix::fs::open(through.as_str(), flags, Mode::empty()) {
        Ok(fd) => Ok(Ok(fd)),
        Err(rustix::io::Errno::NOENT) if !Path::new("/proc/self/fd").exists() => {
            let fd = rustix::fs::open(path, flags, Mode::empty())?;
            let again = rustix::fs::fstat(&fd)?;
            if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino) {
                return Err(rustix::io::Errno::AGAIN);
            }
            Ok(Ok(fd))
        }
        Err(e) => Err(e),
    }
}

/// Only a regular file is read (a symbolic link is followed, and the type is checked before
/// the file is opened for reading, on a descriptor that pins it: see [`open_regular`]), and at
/// most `max_size` bytes of it. `None` when it is empty and not yet applied (see [`read_file`]).
fn read_content(path: &Path, limits: ReadLimits, occasion: Occasion) -> Option<Content> {
    let max_size = limits.max_size;
    let failed = |message: String, transient: bool| {
        let message = if transient {
            format!("{message}; it is read again shortly")
        } else {
            message
        };
        let err = manifest_error(path, None, None, message);
        (FileContent::Broken(vec![err]), None, transient)
    };
    let broken = |message: String| failed(message, false);
    let fd = match open_regular(path, limits.follow_links) {
        Ok(Ok(fd)) => fd,
        Ok(Err(Unopened::Kind(kind))) => {
            return Some(broken(format!(
                "is {} (after following links), not a regular file: only regular files are read as manifests; remove it or give it another extension",
                file_type_name(kind)
            )));
        }
        Ok(Err(Unopened::LeadsOut)) => {
            return Some(broken(
                "is a symbolic link that leads out of the manifest directory (or an absolute one), which kubevol does not follow: kubevol reads as root, and a link must not read what its writer may not; copy the file into the directory, link it relatively from within it, or start kubevol with --manifests-follow-links if every writer of the directory may read whatever its links lead to".into(),
            ));
        }
        Err(rustix::io::Errno::NOENT) => {
            return Some((FileContent::Gone, None, false));
        }
        Err(e) => {
            let message = format!("cannot open: {}", std::io::Error::from(e));
            return Some(failed(
                message,
                is_transient(e) || e == rustix::io::Errno::AGAIN,
            ));
        }
    };
    let stat = match rustix::fs::fstat(&fd) {
        Ok(st) => st,
        Err(e) => return Some(broken(format!("cannot stat: {}", std::io::Error::from(e)))),
    };
    let too_big = |size: u64| {
        format!(
            "is {size} bytes, more than the limit of {max_size} bytes for one manifest file: split it, or raise the limit (--max-manifest-size)"
        )
    };
    let size = stat.st_size as u64;
    if size > max_size {
        return Some(broken(too_big(size)));
    }
    let mut bytes = Vec::with_capacity(size as usize);
    // A file that grows while it is read is still cut at the limit.
    if let Err(e) = std::io::Read::read_to_end(
        &mut std::io::Read::take(std::fs::File::from(fd), max_size + 1),
        &mut bytes,
    ) {
        let transient = e
            .raw_os_error()
            .is_some_and(|n| is_transient(rustix::io::Errno::from_raw_os_error(n)));
        return Some(failed(format!("cannot read: {e}"), transient));
    }
    if bytes.len() as u64 > max_size {
        return Some(broken(too_big(bytes.len() as u64)));
    }
    if bytes.is_empty() && occasion != Occasion::Quiet {
        return None;
    }
    let text = match String::from_utf8(bytes) {
        Ok(t) => t,
        Err(e) => {
            return Some(broken(format!(
                "is not UTF-8 text (byte {} is not valid): manifests are YAML or JSON text",
                e.utf8_error().valid_up_to()
            )))
        }
    };
    let parsed = parse_file(path, &text);
    let (objects, errors) = (parsed.objects, parsed.errors);
    if errors.is_empty() {
        debug!(file = %path.display(), objects = objects.len(), "manifest loaded");
        Some((
            FileContent::Objects(objects),
            Some((parsed.skipped, parsed.warnings)),
            false,
        ))
    } else {
        // A file with any error is not applied: what it delivered before stays, so a
        // half-written edit never takes a running pod's volumes away.
        Some((FileContent::Broken(errors), None, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::fs::inotify;

    /// An empty file gives no change when a listing finds it or a close event reads it (a writer
    /// may be between its truncation and its writes), and defines nothing once it has stayed
    /// empty (`Quiet`).
    #[test]
    fn an_empty_file_is_applied_only_once_quiet() {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("pod.yaml");
        std::fs::write(&path, "").unwrap();
        for occasion in [Occasion::Listed, Occasion::Written] {
            let (changes, transient) = read_file(&path, ReadLimits::default(), occasion);
            assert!(
                changes.is_empty() && !transient,
                "{occasion:?}: {changes:?}"
            );
        }
        let (changes, _) = read_file(&path, ReadLimits::default(), Occasion::Quiet);
        assert!(matches!(
            &changes[0],
            Change::File { content: FileContent::Objects(o), .. } if o.is_empty()
        ));
    }

    /// A manifest that is a link to a FIFO (or a device, whose open may act: rewind a tape,
    /// start a watchdog) is refused without ever being opened: its type is read through an
    /// `O_PATH` descriptor, which the kernel does not report as an open.
    #[test]
    fn a_link_to_something_not_a_regular_file_is_refused_without_opening_it() {
        let t = tempfile::tempdir().unwrap();
        let fifo = t.path().join("fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
        let manifest = t.path().join("pod.yaml");
        std::os::unix::fs::symlink("fifo", &manifest).unwrap();
        let watch =
            inotify::init(inotify::CreateFlags::NONBLOCK | inotify::CreateFlags::CLOEXEC).unwrap();
        inotify::add_watch(&watch, &fifo, inotify::WatchFlags::OPEN).unwrap();
        let (changes, transient) = read_file(&manifest, ReadLimits::default(), Occasion::Listed);
        assert!(!transient);
        let Change::File {
            content: FileContent::Broken(errors),
            ..
        } = &changes[0]
        else {
            panic!("not refused")
        };
        assert!(
            errors[0]
                .message
                .contains("is a FIFO (named pipe) (after following links)"),
            "{}",
            errors[0].message
        );
        let mut buf = [std::mem::MaybeUninit::uninit(); 1024];
        let mut events = inotify::Reader::new(&watch, &mut buf);
        let opened = events.next().map(|e| e.events());
        assert_eq!(opened, Err(rustix::io::Errno::AGAIN), "the FIFO was opened");
        // A regular file behind a link is read.
        let real = t.path().join("real");
        std::fs::write(
            &real,
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n",
        )
        .unwrap();
        let link = t.path().join("cm.yaml");
        std::os::unix::fs::symlink("real", &link).unwrap();
        let (changes, _) = read_file(&link, ReadLimits::default(), Occasion::Listed);
        assert!(matches!(
            &changes[0],
            Change::File { content: FileContent::Objects(o), .. } if o.len() == 1
        ));
    }

    /// A link that leads out of the manifest directory (to a file its writer may not read, say)
    /// is not followed, nor an absolute one, unless links are followed wherever they lead; one
    /// that stays beneath it is, through a subdirectory as a ConfigMap's volume links its keys.
    #[test]
    fn a_link_out_of_the_manifest_directory_is_not_followed() {
        let t = tempfile::tempdir().unwrap();
        let (dir, elsewhere) = (t.path().join("manifests"), t.path().join("private"));
        std::fs::create_dir_all(dir.join("..2026/sub")).unwrap();
        std::fs::create_dir(&elsewhere).unwrap();
        let cm =
            |name: &str| format!("apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: {name}}}\n");
        std::fs::write(elsewhere.join("secret.yaml"), cm("secret")).unwrap();
        std::fs::write(dir.join("..2026/sub/inside.yaml"), cm("inside")).unwrap();
        std::os::unix::fs::symlink("..2026", dir.join("..data")).unwrap();
        let link = |name: &str, to: &Path| {
            std::os::unix::fs::symlink(to, dir.join(name)).unwrap();
            dir.join(name)
        };
        let out_relative = link("out.yaml", Path::new("../private/secret.yaml"));
        let out_absolute = link("abs.yaml", &elsewhere.join("secret.yaml"));
        let inside = link("inside.yaml", Path::new("..data/sub/inside.yaml"));
        let objects = |path: &Path, follow_links: bool| {
            let limits = ReadLimits {
                follow_links,
                ..ReadLimits::default()
            };
            match read_file(path, limits, Occasion::Listed).0.remove(0) {
                Change::File {
                    content: FileContent::Objects(o),
                    ..
                } => Ok(o.len()),
                Change::File {
                    content: FileContent::Broken(e),
                    ..
                } => Err(e[0].message.clone()),
                other => panic!("{other:?}"),
            }
        };
        for path in [&out_relative, &out_absolute] {
            let e = objects(path, false).unwrap_err();
            assert!(
                e.contains("leads out of the manifest directory")
                    && e.contains("--manifests-follow-links"),
                "{e}"
            );
            assert_eq!(objects(path, true), Ok(1));
        }
        assert_eq!(objects(&inside, false), Ok(1));
    }
}
