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

/// Reads one manifest file as the store takes it: its objects (and the names of those of kinds
/// kubevol does not run), its errors, or that it is gone; and whether the read failed for a
/// reason that passes by itself (too many open files, an I/O error), so that it is tried again.
pub fn read_file(path: &Path, max_size: u64) -> (Vec<Change>, bool) {
    let (content, skipped, transient) = read_content(path, max_size);
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

/// Only a regular file is read (a symbolic link is followed, and the type is checked on the
/// opened descriptor, so nothing can be swapped in between), opened non-blocking so that a
/// FIFO or a device never blocks, and at most `max_size` bytes of it.
fn read_content(path: &Path, max_size: u64) -> Content {
    use rustix::fs::{FileType, Mode, OFlags};
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
    let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY;
    let fd = match rustix::fs::open(path, flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => {
            return (FileContent::Gone, None, false);
        }
        Err(e) => {
            let message = format!("cannot open: {}", std::io::Error::from(e));
            return failed(message, is_transient(e));
        }
    };
    let stat = match rustix::fs::fstat(&fd) {
        Ok(st) => st,
        Err(e) => return broken(format!("cannot stat: {}", std::io::Error::from(e))),
    };
    let kind = FileType::from_raw_mode(stat.st_mode);
    if kind != FileType::RegularFile {
        return broken(format!(
            "is {} (after following links), not a regular file: only regular files are read as manifests; remove it or give it another extension",
            file_type_name(kind)
        ));
    }
    let too_big = |size: u64| {
        format!(
            "is {size} bytes, more than the limit of {max_size} bytes for one manifest file: split it, or raise the limit (--max-manifest-size)"
        )
    };
    let size = stat.st_size as u64;
    if size > max_size {
        return broken(too_big(size));
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
        return failed(format!("cannot read: {e}"), transient);
    }
    if bytes.len() as u64 > max_size {
        return broken(too_big(bytes.len() as u64));
    }
    let text = match String::from_utf8(bytes) {
        Ok(t) => t,
        Err(e) => {
            return broken(format!(
                "is not UTF-8 text (byte {} is not valid): manifests are YAML or JSON text",
                e.utf8_error().valid_up_to()
            ))
        }
    };
    let parsed = parse_file(path, &text);
    let (objects, errors) = (parsed.objects, parsed.errors);
    if errors.is_empty() {
        debug!(file = %path.display(), objects = objects.len(), "manifest loaded");
        (
            FileContent::Objects(objects),
            Some((parsed.skipped, parsed.warnings)),
            false,
        )
    } else {
        // A file with any error is not applied: what it delivered before stays, so a
        // half-written edit never takes a running pod's volumes away.
        (FileContent::Broken(errors), None, false)
    }
}
