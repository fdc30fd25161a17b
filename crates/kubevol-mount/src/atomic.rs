//! The atomic writer: how configMap, secret, downwardAPI and projected volumes change their
//! files without a reader ever seeing half an update.
//!
//! The layout is the kubelet's, so tools that know it keep working:
//!
//! ```text
//! <volume>/..2026_11_21_10_00_00.123456789/   the payload, written whole before it is used
//! <volume>/..data -> ..2026_11_21_10_00_00.123456789
//! <volume>/<key> -> ..data/<key>              one link per top-level entry
//! ```
//!
//! An update writes a new timestamped directory, points `..data_tmp` at it and renames that over
//! `..data` (the one atomic step), then adds and removes top-level links and the old directory.
//! Every operation is relative to the volume directory's descriptor and never follows a link:
//! `..data` is read with readlinkat and must name a payload directory of this volume, visible
//! entries must be exactly the links the writer makes, and payload directories are walked with
//! `O_NOFOLLOW`. Anything else is reported as [`MountError::Unsafe`] and left alone.
//!
//! Each run first converges whatever an interrupted run left: a stale `..data_tmp`, payload
//! directories `..data` does not point to, missing or extra links. So a writer killed at any
//! step leaves a volume that the next run completes.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::io::Write;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use rustix::fs::{AtFlags, FileType, Gid, Mode, OFlags};
use rustix::io::Errno;

use crate::at::io;
use crate::safe::Dir;
use crate::walk::{At, Visit};
use crate::MountError;

/// The link that names the current payload.
pub const DATA_DIR: &str = "..data";
/// The link made before the swap.
pub const DATA_DIR_TMP: &str = "..data_tmp";

/// One file to write.
#[derive(Clone, Copy, Debug)]
pub struct Entry<'a> {
    /// The cleaned relative path (validated again here).
    pub path: &'a str,
    /// The content.
    pub data: &'a [u8],
    /// The permission bits.
    pub mode: u32,
    /// The owner (`defaultUser`, an item's `user`); none: the writer's own user.
    pub user: Option<u32>,
}

/// The steps of a write, reported to a hook (tests stop the process at each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// A stale `..data_tmp` was removed.
    StaleTmpRemoved,
    /// The new payload directory exists (empty).
    PayloadDirCreated,
    /// One file of the new payload was written.
    FileWritten,
    /// The new payload is complete, owner and modes set.
    PayloadWritten,
    /// `..data_tmp` points at the new payload.
    TmpLinked,
    /// `..data` was swapped to the new payload.
    Swapped,
    /// The visible links exist.
    VisibleLinked,
    /// Links of entries no longer in the payload are gone.
    OldVisibleRemoved,
    /// Old payload directories are gone.
    OldPayloadRemoved,
}

/// What a write did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Written {
    /// The payload on disk already matched; nothing was rewritten.
    Unchanged,
    /// A new payload was swapped in.
    Updated,
}

/// How files are owned: with an fsGroup, files and directories get that group and group read
/// (and search) permission, directories the set-group-ID bit, as the kubelet sets them on
/// read-only volumes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ownership {
    /// The group (the pod's fsGroup).
    pub gid: Option<u32>,
}

const PAYLOAD_DIR_MODE: u32 = 0o755;

impl Ownership {
    fn file_mode(&self, mode: u32) -> u32 {
        match self.gid {
            Some(_) => (mode & 0o777) | 0o440,
            None => mode & 0o777,
        }
    }

    fn dir_mode(&self) -> u32 {
        match self.gid {
            Some(_) => PAYLOAD_DIR_MODE | 0o550 | 0o2000,
            None => PAYLOAD_DIR_MODE,
        }
    }

    fn apply(&self, fd: &OwnedFd, mode: u32, path: &Path) -> Result<(), MountError> {
        if let Some(gid) = self.gid {
            rustix::fs::fchown(fd, None, Some(Gid::from_raw(gid))).map_err(io("chown", path))?;
        }
        rustix::fs::fchmod(fd, Mode::from_raw_mode(mode)).map_err(io("chmod", path))
    }
}

/// Whether `name` is a payload directory name this writer makes: `..` followed by a UTC
/// timestamp `YYYY_MM_DD_HH_MM_SS.` and digits.
pub fn is_payload_dir_name(name: &[u8]) -> bool {
    let Some(rest) = name.strip_prefix(b"..") else {
        return false;
    };
    // YYYY_MM_DD_HH_MM_SS = 19 bytes, then '.', then at least one digit.
    if rest.len() < 21 {
        return false;
    }
    let (stamp, tail) = rest.split_at(19);
    let stamp_ok = stamp.iter().enumerate().all(|(i, c)| match i {
        4 | 7 | 10 | 13 | 16 => *c == b'_',
        _ => c.is_ascii_digit(),
    });
    stamp_ok && tail[0] == b'.' && tail[1..].iter().all(u8::is_ascii_digit)
}

fn payload_dir_name(now: SystemTime, attempt: u32) -> String {
    let d = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, day) = civil_from_days(days as i64);
    format!(
        "..{y:04}_{m:02}_{day:02}_{:02}_{:02}_{:02}.{:09}{}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_nanos(),
        if attempt == 0 {
            String::new()
        } else {
            attempt.to_string()
        }
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn unsafe_entry(dir: &Dir, name: &str, reason: impl Into<String>) -> MountError {
    MountError::Unsafe {
        path: dir.child_path(OsStr::new(name)),
        reason: reason.into(),
    }
}

/// The top-level names of `entries` (each a visible link), with the owner of the first entry
/// below it that has one (the link's owner).
type Top<'a> = BTreeMap<&'a str, Option<u32>>;

/// The most path elements an entry may have (the validation of item paths refuses deeper
/// ones first, with the field named).
pub const MAX_DEPTH: usize = 32;

fn check_entries<'a>(entries: &[Entry<'a>]) -> Result<Top<'a>, MountError> {
    let mut top: Top<'a> = BTreeMap::new();
    for e in entries {
        let ok = !e.path.is_empty()
            && !e.path.starts_with("..")
            && e.path
                .split('/')
                .all(|c| !c.is_empty() && c != "." && c != ".." && c.len() <= 255)
            && e.path.len() <= 4096
            && e.path.split('/').count() <= MAX_DEPTH;
        if !ok {
            return Err(MountError::NotRelative {
                path: e.path.into(),
            });
        }
        let owner = top
            .entry(e.path.split('/').next().unwrap_or(e.path))
            .or_default();
        *owner = owner.or(e.user);
    }
    Ok(top)
}

/// Reads `..data`: the payload directory it names, or `None` when there is no `..data` or it
/// dangles. A `..data` that is not a link to a payload directory name is refused.
fn current_payload(dir: &Dir) -> Result<Option<(String, Dir)>, MountError> {
    let target = match rustix::fs::readlinkat(&dir.fd, DATA_DIR, Vec::new()) {
        Ok(t) => t.into_bytes(),
        Err(Errno::NOENT) => return Ok(None),
        Err(Errno::INVAL) => {
            return Err(unsafe_entry(dir, DATA_DIR, "is not a symbolic link"));
        }
        Err(e) => return Err(io("readlink", &dir.child_path(OsStr::new(DATA_DIR)))(e)),
    };
    if !is_payload_dir_name(&target) {
        return Err(unsafe_entry(
            dir,
            DATA_DIR,
            format!(
                "points to {:?}, not to a payload directory of this volume",
                String::from_utf8_lossy(&target)
            ),
        ));
    }
    let name = String::from_utf8_lossy(&target).into_owned();
    match dir.open_child(OsStr::new(&name)) {
        Ok(d) => Ok(Some((name, d))),
        Err(e) if e.is_not_found() => Ok(None),
        Err(MountError::Symlink { path }) => Err(MountError::Unsafe {
            path,
            reason: "is a symbolic link where a payload directory belongs".into(),
        }),
        Err(e) => Err(e),
    }
}

/// How the payload on disk compares with the entries to write.
struct Compare<'e> {
    /// The entries by path.
    want: BTreeMap<&'e str, &'e Entry<'e>>,
    own: Ownership,
    /// The writer's own user: the owner of an entry that names none.
    writer: u32,
    /// Files on disk seen so far.
    seen: usize,
    /// A file on disk differs from its entry, or is not one; later files are not read.
    differs: bool,
}

impl Compare<'_> {
    fn matches(&self) -> bool {
        !self.differs && self.seen == self.want.len()
    }
}

fn payload_link(path: PathBuf) -> MountError {
    MountError::Unsafe {
        path,
        reason: "is a symbolic link inside a payload directory".into(),
    }
}

/// Compares each file of a payload directory with its entry, reading no file after the first
/// difference; every entry is still looked at, so that anything but a regular file or a
/// directory anywhere in the payload is refused.
impl Visit for Compare<'_> {
    fn other(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        ft: FileType,
        at: &At<'_>,
    ) -> Result<(), MountError> {
        match ft {
            FileType::RegularFile => {
                self.seen += 1;
                if self.differs {
                    return Ok(());
                }
                let rel = at.relative(name);
                match self.want.get(rel.as_str()) {
                    Some(e) => {
                        let same =
                            file_is(parent, name, e, self.own, self.writer, || at.child(name))?;
                        self.differs = !same;
                    }
                    None => self.differs = true,
                }
                Ok(())
            }
            FileType::Symlink => Err(payload_link(at.child(name))),
            _ => Err(MountError::Unsafe {
                path: at.child(name),
                reason: "is not a regular file".into(),
            }),
        }
    }

    fn descend(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        at: &At<'_>,
    ) -> Result<Option<OwnedFd>, MountError> {
        crate::walk::open_dir(parent, name, at).map_err(|e| match e {
            MountError::Symlink { path } => payload_link(path),
            e => e,
        })
    }
}

/// Whether the payload file `name` has exactly the entry's content, mode and group: its size
/// is looked at before its content is read, in one read.
fn file_is(
    parent: BorrowedFd<'_>,
    name: &OsStr,
    e: &Entry<'_>,
    own: Ownership,
    writer: u32,
    path: impl Fn() -> PathBuf,
) -> Result<bool, MountError> {
    let fd = match rustix::fs::openat(
        parent,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(Errno::LOOP) => return Err(payload_link(path())),
        Err(e) => return Err(io("open", &path())(e)),
    };
    let st = rustix::fs::fstat(&fd).map_err(io("stat", &path()))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(MountError::Unsafe {
            path: path(),
            reason: "is not a regular file".into(),
        });
    }
    let owner = e.user.unwrap_or(writer);
    if u64::try_from(st.st_size).ok() != Some(e.data.len() as u64)
        || st.st_mode & 0o7777 != own.file_mode(e.mode)
        || own.gid.is_some_and(|g| g != st.st_gid)
        || st.st_uid != owner
    {
        return Ok(false);
    }
    let mut data = vec![0u8; e.data.len()];
    let mut got = 0;
    while got < data.len() {
        match rustix::io::read(&fd, &mut data[got..]) {
            Ok(0) => return Ok(false),
            Ok(n) => got += n,
            Err(Errno::INTR) => {}
            Err(err) => return Err(io("read", &path())(err)),
        }
    }
    Ok(data == e.data)
}

/// The directories of the payload open along the path of the last entry written, root first:
/// the next entry's directories are made and opened from where its path leaves that chain, so
/// a payload of many entries holds at most one descriptor per level of its deepest path
/// (bounded by [`MAX_DEPTH`]), never one per directory it has (60 items of 300 levels held
/// 18,000), and no recursion.
struct Chain {
    open: Vec<(String, Dir)>,
}

impl Chain {
    /// The directory `rel` of the payload (`/`-separated, checked), made where missing.
    fn dir<'c>(
        &'c mut self,
        root: &'c Dir,
        rel: &str,
        own: Ownership,
    ) -> Result<&'c Dir, MountError> {
        let names: Vec<&str> = rel.split('/').collect();
        let common = self
            .open
            .iter()
            .zip(&names)
            .take_while(|((have, _), want)| have == *want)
            .count();
        self.open.truncate(common);
        for name in &names[common..] {
            let parent = self.open.last().map_or(root, |(_, d)| d);
            let path = parent.child_path(OsStr::new(name));
            match rustix::fs::mkdirat(&parent.fd, *name, Mode::from_raw_mode(0o700)) {
                Ok(()) | Err(Errno::EXIST) => {}
                Err(e) => return Err(io("mkdir", &path)(e)),
            }
            let d = parent.open_child(OsStr::new(name))?;
            own.apply(&d.fd, own.dir_mode(), &path)?;
            self.open.push((name.to_string(), d));
        }
        Ok(self.open.last().map_or(root, |(_, d)| d))
    }
}

fn write_file(dir: &Dir, name: &str, e: &Entry<'_>, own: Ownership) -> Result<(), MountError> {
    let path = dir.child_path(OsStr::new(name));
    let fd = rustix::fs::openat(
        &dir.fd,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(io("create", &path))?;
    if let Some(uid) = e.user {
        rustix::fs::fchown(&fd, Some(rustix::fs::Uid::from_raw(uid)), None)
            .map_err(io("chown", &path))?;
    }
    own.apply(&fd, own.file_mode(e.mode), &path)?;
    let mut f = std::fs::File::from(fd);
    f.write_all(e.data).map_err(|err| MountError::Io {
        op: "write",
        path,
        errno: Errno::from_io_error(&err).unwrap_or(Errno::IO),
    })
}

/// Removes `name` if it is a symbolic link; anything else there is refused.
fn remove_link(dir: &Dir, name: &str) -> Result<(), MountError> {
    match rustix::fs::statat(&dir.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
        Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(io("stat", &dir.child_path(OsStr::new(name)))(e)),
        Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Symlink => {
            match rustix::fs::unlinkat(&dir.fd, name, AtFlags::empty()) {
                Ok(()) | Err(Errno::NOENT) => Ok(()),
                Err(e) => Err(io("unlink", &dir.child_path(OsStr::new(name)))(e)),
            }
        }
        Ok(_) => Err(unsafe_entry(dir, name, "is not a symbolic link")),
    }
}

fn visible_target(name: &str) -> String {
    format!("{DATA_DIR}/{name}")
}

/// Makes the link of each top-level entry; an entry that exists must be exactly that link.
fn link_visible(dir: &Dir, top: &Top<'_>) -> Result<(), MountError> {
    for (name, owner) in top {
        let want = visible_target(name);
        match rustix::fs::readlinkat(&dir.fd, *name, Vec::new()) {
            Ok(t) if t.as_bytes() == want.as_bytes() => {
                own_link(dir, name, *owner)?;
                continue;
            }
            Ok(t) => {
                return Err(unsafe_entry(
                    dir,
                    name,
                    format!(
                        "is a symbolic link to {:?}, not to {want:?}",
                        t.to_string_lossy()
                    ),
                ))
            }
            Err(Errno::NOENT) => {}
            Err(Errno::INVAL) => {
                return Err(unsafe_entry(
                    dir,
                    name,
                    format!("is not the symbolic link to {want:?} the volume needs"),
                ))
            }
            Err(e) => return Err(io("readlink", &dir.child_path(OsStr::new(name)))(e)),
        }
        rustix::fs::symlinkat(want.as_str(), &dir.fd, *name)
            .map_err(io("symlink", &dir.child_path(OsStr::new(name))))?;
        own_link(dir, name, *owner)?;
    }
    Ok(())
}

/// Gives the visible link `name` its entry's owner, as the kubelet does (the link itself,
/// never what it points at).
fn own_link(dir: &Dir, name: &str, owner: Option<u32>) -> Result<(), MountError> {
    let Some(uid) = owner else {
        return Ok(());
    };
    let uid = rustix::fs::Uid::from_raw(uid);
    rustix::fs::chownat(&dir.fd, name, Some(uid), None, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(io("chown", &dir.child_path(OsStr::new(name))))
}

/// Removes the writer's links whose entries are no longer in the payload; other entries are
/// not the writer's and are left alone.
fn unlink_old_visible(dir: &Dir, top: &Top<'_>) -> Result<(), MountError> {
    for (name, ft) in dir.entries()? {
        if name.starts_with(b"..") || ft != FileType::Symlink {
            continue;
        }
        let name = String::from_utf8_lossy(&name).into_owned();
        if top.contains_key(name.as_str()) {
            continue;
        }
        let ours = rustix::fs::readlinkat(&dir.fd, name.as_str(), Vec::new())
            .is_ok_and(|t| t.as_bytes() == visible_target(&name).as_bytes());
        if ours {
            match rustix::fs::unlinkat(&dir.fd, name.as_str(), AtFlags::empty()) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(e) => return Err(io("unlink", &dir.child_path(OsStr::new(&name)))(e)),
            }
        }
    }
    Ok(())
}

/// Removes payload directories other than `keep`, staying on the volume's filesystem.
fn remove_old_payloads(dir: &Dir, keep: &str) -> Result<(), MountError> {
    for (name, ft) in dir.entries()? {
        if ft != FileType::Directory || !is_payload_dir_name(&name) || name == keep.as_bytes() {
            continue;
        }
        dir.remove_dir_all_one_fs(&String::from_utf8_lossy(&name))?;
    }
    Ok(())
}

/// Converges the volume on the current payload: links present, stale `..data_tmp` and old
/// payload directories gone.
fn converge(
    dir: &Dir,
    current: &str,
    top: &Top<'_>,
    hook: &mut dyn FnMut(Step),
) -> Result<(), MountError> {
    link_visible(dir, top)?;
    hook(Step::VisibleLinked);
    unlink_old_visible(dir, top)?;
    hook(Step::OldVisibleRemoved);
    remove_old_payloads(dir, current)?;
    hook(Step::OldPayloadRemoved);
    Ok(())
}

/// Writes every entry into the new payload directory `new_name`.
fn write_payload(
    dir: &Dir,
    new_name: &str,
    entries: &[Entry<'_>],
    own: Ownership,
    hook: &mut dyn FnMut(Step),
) -> Result<(), MountError> {
    let payload = dir.open_child(OsStr::new(new_name))?;
    own.apply(&payload.fd, own.dir_mode(), &payload.path)?;
    hook(Step::PayloadDirCreated);
    let mut chain = Chain { open: Vec::new() };
    // In path order, so that entries of one directory follow each other.
    let mut order: Vec<&Entry<'_>> = entries.iter().collect();
    order.sort_by(|a, b| a.path.cmp(b.path));
    for e in order {
        let (parent, name) = match e.path.rsplit_once('/') {
            Some((p, n)) => (Some(p), n),
            None => (None, e.path),
        };
        let parent_dir = match parent {
            Some(p) => chain.dir(&payload, p, own)?,
            None => &payload,
        };
        write_file(parent_dir, name, e, own)?;
        hook(Step::FileWritten);
    }
    hook(Step::PayloadWritten);
    Ok(())
}

/// Makes the volume directory hold exactly `entries`, atomically. Unchanged content is not
/// rewritten (only what an interrupted run left is completed). `hook` is told of each step.
pub fn write(
    dir: &Dir,
    entries: &[Entry<'_>],
    own: Ownership,
    hook: &mut dyn FnMut(Step),
) -> Result<Written, MountError> {
    let top = check_entries(entries)?;
    let current = current_payload(dir)?;
    if let Some((name, payload)) = &current {
        let mut cmp = Compare {
            want: entries.iter().map(|e| (e.path, e)).collect(),
            own,
            writer: rustix::process::geteuid().as_raw(),
            seen: 0,
            differs: false,
        };
        crate::walk::walk(payload.fd(), payload.path(), &mut cmp)?;
        if cmp.matches() {
            remove_link(dir, DATA_DIR_TMP)?;
            converge(dir, name, &top, hook)?;
            return Ok(Written::Unchanged);
        }
    }
    remove_link(dir, DATA_DIR_TMP)?;
    hook(Step::StaleTmpRemoved);

    let now = SystemTime::now();
    let mut attempt = 0;
    let new_name = loop {
        let name = payload_dir_name(now, attempt);
        match rustix::fs::mkdirat(&dir.fd, name.as_str(), Mode::from_raw_mode(0o700)) {
            Ok(()) => break name,
            Err(Errno::EXIST) if attempt < 100 => attempt += 1,
            Err(e) => return Err(io("mkdir", &dir.child_path(OsStr::new(&name)))(e)),
        }
    };
    // Until the swap, a failure (a full disk among them) leaves the previous content in place;
    // the half-written payload is removed so that retries do not pile up.
    let written = write_payload(dir, &new_name, entries, own, hook).and_then(|()| {
        rustix::fs::symlinkat(new_name.as_str(), &dir.fd, DATA_DIR_TMP)
            .map_err(io("symlink", &dir.child_path(OsStr::new(DATA_DIR_TMP))))
    });
    if let Err(e) = written {
        let _ = remove_link(dir, DATA_DIR_TMP);
        let _ = dir.remove_dir_all_one_fs(&new_name);
        return Err(e);
    }
    hook(Step::TmpLinked);
    rustix::fs::renameat(&dir.fd, DATA_DIR_TMP, &dir.fd, DATA_DIR)
        .map_err(io("rename", &dir.child_path(OsStr::new(DATA_DIR))))?;
    hook(Step::Swapped);
    converge(dir, &new_name, &top, hook)?;
    Ok(Written::Updated)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_dir_names() {
        let t = UNIX_EPOCH + std::time::Duration::new(1_763_719_200, 42);
        let name = payload_dir_name(t, 0);
        assert_eq!(name, "..2025_11_21_10_00_00.000000042");
        assert!(is_payload_dir_name(name.as_bytes()));
        assert!(is_payload_dir_name(payload_dir_name(t, 3).as_bytes()));
        for bad in [
            "..data",
            "..data_tmp",
            "..",
            "..2025_11_21_10_00_00.",
            "../etc",
            "..2025_11_21_10_00_00.1/x",
            "2025_11_21_10_00_00.1",
        ] {
            assert!(!is_payload_dir_name(bad.as_bytes()), "{bad}");
        }
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }
}
