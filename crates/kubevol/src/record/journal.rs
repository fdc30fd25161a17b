//! The record's journal: one append-only file of JSON lines, each a record written or removed.
//! A batch of changes is one `write` and, when any of them is an intent, one `fdatasync`; the
//! latest line of each volume is its record. When the lines outgrow twice the live records the
//! journal is compacted: the live records are written to a new file, synced and renamed over
//! the old one.
//!
//! Reading it back: a last line without its newline is a write that was cut short, whose
//! side effect never started (it waits for the write and its sync), so it is dropped. A line
//! that cannot be parsed before other good lines is reported as a corrupt record; the journal
//! is then compacted without it, and a copy of it as it was is kept as `journal.corrupt`.
//! Records of the earlier layout (a JSON file per volume) are read too and moved into the
//! journal.

use kubevol_core::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kubevol_core::{PodUid, UniqueVolumeName};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::{CorruptRecord, DeviceRecord, PodVolumeRecord};

/// The journal's file name in the record's directory.
pub const JOURNAL: &str = "journal";
/// A compaction being written.
const JOURNAL_NEW: &str = "journal.new";
/// The journal as it was before a compaction dropped a corrupt line from it.
const JOURNAL_CORRUPT: &str = "journal.corrupt";
/// Dead lines tolerated beyond the live records before a compaction.
pub(super) const COMPACT_SLACK: usize = 4096;
/// Space kept allocated past the journal's end (`fallocate` with `KEEP_SIZE`), refilled when
/// half of it is used: on a full disk the journal still takes about 1,700 lines, which is
/// what the teardowns that free space need (two lines each).
pub(super) const RESERVE: u64 = 2 << 20;

/// What a record is about: a pod's volume, or a volume node-wide.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Key {
    Pod(PodUid, UniqueVolumeName),
    Device(UniqueVolumeName),
}

/// A line as read.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) enum Line {
    PodVolume(PodVolumeRecord),
    RemovePodVolume {
        pod: PodUid,
        unique: UniqueVolumeName,
    },
    Device(DeviceRecord),
    RemoveDevice {
        unique: UniqueVolumeName,
    },
}

/// A line as written.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) enum LineRef<'a> {
    PodVolume(&'a PodVolumeRecord),
    RemovePodVolume {
        pod: &'a PodUid,
        unique: &'a UniqueVolumeName,
    },
    Device(&'a DeviceRecord),
    RemoveDevice {
        unique: &'a UniqueVolumeName,
    },
}

impl LineRef<'_> {
    /// The line's bytes, without its newline.
    pub(super) fn encode(&self) -> std::io::Result<Arc<[u8]>> {
        let mut buf = Vec::new();
        self.encode_into(&mut buf)?;
        Ok(buf.into())
    }

    /// Appends the line's bytes, without its newline, to `buf` (nothing on an error).
    pub(super) fn encode_into(&self, buf: &mut Vec<u8>) -> std::io::Result<()> {
        let begins = buf.len();
        let written = match self {
            LineRef::PodVolume(r) => super::encode::pod_volume_line(buf, r),
            _ => serde_json::to_writer(&mut *buf, self).map_err(std::io::Error::other),
        };
        if written.is_err() {
            buf.truncate(begins);
        }
        written
    }
}

impl Line {
    fn key(&self) -> Key {
        match self {
            Line::PodVolume(r) => Key::Pod(r.pod.uid.clone(), r.unique_name.clone()),
            Line::RemovePodVolume { pod, unique } => Key::Pod(pod.clone(), unique.clone()),
            Line::Device(r) => Key::Device(r.unique_name.clone()),
            Line::RemoveDevice { unique } => Key::Device(unique.clone()),
        }
    }

    fn is_removal(&self) -> bool {
        matches!(
            self,
            Line::RemovePodVolume { .. } | Line::RemoveDevice { .. }
        )
    }
}

/// Each key's latest line (a record, never a removal), as read: the journal at open, the
/// record files of the earlier layout.
pub(super) type Lines = HashMap<Key, Arc<[u8]>>;

/// Where a live record's line lies in the journal, with a checksum of it: telling whether a
/// new line is the same needs no copy of the old one in memory, and a read only when the
/// checksums agree.
#[derive(Clone, Copy, Debug)]
pub(super) struct Place {
    at: u64,
    len: u32,
    sum: u64,
}

/// A checksum of a line, to tell lines apart without reading them (equal sums are confirmed
/// by reading the line): fast, and the same for the same bytes for as long as the process runs.
fn checksum(line: &[u8]) -> u64 {
    use std::hash::BuildHasher;
    foldhash::quality::FixedState::default().hash_one(line)
}

impl Place {
    /// The place of `line`, written at `at`.
    pub(super) fn of(at: u64, line: &[u8]) -> Place {
        Place {
            at,
            len: u32::try_from(line.len()).unwrap_or(u32::MAX),
            sum: checksum(line),
        }
    }

    /// The line here, read from `file`.
    pub(super) fn read(&self, file: &File) -> std::io::Result<Vec<u8>> {
        let mut line = vec![0; self.len as usize];
        file.read_exact_at(&mut line, self.at)?;
        Ok(line)
    }

    /// Whether the line here is `line`: the length and checksum, then the bytes.
    pub(super) fn holds(&self, file: &File, line: &[u8]) -> bool {
        self.len as usize == line.len()
            && self.sum == checksum(line)
            && self.read(file).is_ok_and(|l| l == line)
    }
}

/// The live records of an open record: where each key's latest line lies in the journal, and
/// the journal they lie in, open for reading. A compaction replaces both at once, so a reader
/// that takes them together reads the lines they name even while a new journal is renamed
/// over the old one.
pub(super) struct Live {
    places: HashMap<Key, Place>,
    file: Arc<File>,
}

impl Live {
    /// The live records at `places` in the journal `file`.
    pub(super) fn new(places: HashMap<Key, Place>, file: File) -> Live {
        Live {
            places,
            file: Arc::new(file),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.places.len()
    }

    pub(super) fn place(&self, key: &Key) -> Option<Place> {
        self.places.get(key).copied()
    }

    /// The journal the places are in.
    pub(super) fn file(&self) -> Arc<File> {
        self.file.clone()
    }

    pub(super) fn set(&mut self, key: Key, place: Option<Place>) {
        match place {
            Some(p) => self.places.insert(key, p),
            None => self.places.remove(&key),
        };
    }

    /// Every key and place, in the order of the journal.
    pub(super) fn in_journal_order(&self) -> Vec<(Key, Place)> {
        let mut out: Vec<(Key, Place)> = self.places.iter().map(|(k, p)| (k.clone(), *p)).collect();
        out.sort_unstable_by_key(|(_, p)| p.at);
        out
    }

    /// Every live line (one read of the journal).
    pub(super) fn lines(&self) -> std::io::Result<Vec<Vec<u8>>> {
        let len = self.file.metadata()?.len();
        let mut all = vec![0; usize::try_from(len).map_err(std::io::Error::other)?];
        self.file.read_exact_at(&mut all, 0)?;
        self.places
            .values()
            .map(|p| {
                let (at, end) = (p.at as usize, p.at as usize + p.len as usize);
                all.get(at..end)
                    .map(<[u8]>::to_vec)
                    .ok_or_else(|| std::io::Error::other("a record lies beyond the journal's end"))
            })
            .collect()
    }
}

/// Why a record cannot be read: a corrupt record is reported with it and left out.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// Its file cannot be read.
    #[error("{0}")]
    Read(#[from] std::io::Error),
    /// It is not a record (torn, corrupt, or of another program).
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    /// It is a record of another format version.
    #[error(
        "format version {found} is not {}, the one this kubevol writes",
        super::VERSION
    )]
    Version {
        /// The version it has.
        found: u32,
    },
    /// A record of the earlier layout lies in another pod's directory.
    #[error("it is about pod {about} but lies in {dir}'s directory")]
    Misplaced {
        /// The pod it is about.
        about: kubevol_core::PodUid,
        /// The pod whose directory it lies in.
        dir: kubevol_core::PodUid,
    },
}

/// Parses one line, checking the records' format version.
pub(super) fn parse(line: &[u8]) -> Result<Line, FormatError> {
    let parsed: Line = serde_json::from_slice(line)?;
    let version = match &parsed {
        Line::PodVolume(r) => r.version,
        Line::Device(r) => r.version,
        _ => super::VERSION,
    };
    if version != super::VERSION {
        return Err(FormatError::Version { found: version });
    }
    Ok(parsed)
}

/// The journal as read.
pub(super) struct Read {
    pub live: Lines,
    /// Where each live line read from the journal begins in it.
    pub at: HashMap<Key, u64>,
    pub corrupt: Vec<CorruptRecord>,
    /// Lines in the file.
    pub lines: usize,
    /// Whether the file needs rewriting (a torn or corrupt line, or too many dead ones).
    pub needs_compaction: bool,
}

/// Reads the journal at `path` on top of `live` (the records of the earlier layout).
pub(super) fn read(path: &Path, mut live: Lines) -> std::io::Result<Read> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e),
    };
    let mut pieces: Vec<&[u8]> = bytes.split(|b| *b == b'\n').collect();
    // The piece after the last newline: empty, or a write cut short.
    let tail = pieces.pop().unwrap_or_default();
    let mut needs_compaction = !tail.is_empty();
    if !tail.is_empty() {
        warn!(journal = %path.display(), "the record's last line was cut short (a crash while writing it); its side effect never started, so it is dropped");
    }
    let mut bad: Vec<(usize, FormatError)> = Vec::new();
    let mut last_good = 0;
    let mut at = HashMap::default();
    let mut next = 0u64;
    for (i, piece) in pieces.iter().enumerate() {
        let start = next;
        next += piece.len() as u64 + 1;
        if piece.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match parse(piece) {
            Ok(line) => {
                last_good = i + 1;
                let key = line.key();
                if line.is_removal() {
                    live.remove(&key);
                    at.remove(&key);
                } else {
                    at.insert(key.clone(), start);
                    live.insert(key, Arc::from(*piece));
                }
            }
            Err(e) => bad.push((i + 1, e)),
        }
    }
    let mut corrupt = Vec::new();
    for (line, error) in bad {
        needs_compaction = true;
        if line > last_good {
            warn!(journal = %path.display(), line, "the record's last lines cannot be read ({error}): a write cut short by a crash; dropped");
            continue;
        }
        corrupt.push(CorruptRecord {
            path: path.to_path_buf(),
            line: Some(line),
            pod: uid_in(pieces[line - 1]),
            volume: None,
            error: error.to_string(),
        });
    }
    let lines = pieces.len();
    needs_compaction |= lines > 2 * live.len() + COMPACT_SLACK;
    Ok(Read {
        live,
        at,
        corrupt,
        lines,
        needs_compaction,
    })
}

/// A journal just written by [`compact`], open to append to and to read: everything that can
/// fail is done before it takes the journal's name, so that the writer never goes on appending
/// to a journal that has been replaced.
pub(super) struct Compacted {
    /// Where each line lies in it.
    pub places: HashMap<Key, Place>,
    /// Its end, to append to.
    pub append: Appender,
    /// It, to read the lines at `places` from.
    pub read: File,
}

/// The pod UID a line that cannot be parsed still names (its `"uid":"…"`), so that the pod's
/// directory is still known as kubevol's.
fn uid_in(line: &[u8]) -> Option<PodUid> {
    const KEY: &[u8] = b"\"uid\":\"";
    let at = line.windows(KEY.len()).position(|w| w == KEY)? + KEY.len();
    let rest = &line[at..];
    let end = rest.iter().position(|b| *b == b'"')?;
    let uid = std::str::from_utf8(&rest[..end]).ok()?;
    (!uid.is_empty() && !uid.contains('/')).then(|| PodUid::from(uid))
}

/// Writes `live` as a new journal in `dir`, synced, and renames it into place (keeping the
/// journal as it was as `journal.corrupt` when `keep_old`).
pub(super) fn compact<L: AsRef<[u8]>>(
    dir: &Path,
    live: impl Iterator<Item = std::io::Result<(Key, L)>>,
    keep_old: bool,
) -> std::io::Result<Compacted> {
    let new = dir.join(JOURNAL_NEW);
    // A compaction cut short left nothing the journal needs.
    match std::fs::remove_file(&new) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .append(true)
        .create_new(true)
        .open(&new)?;
    let mut out = BufWriter::new(file);
    let mut places = HashMap::default();
    let mut at = 0u64;
    for entry in live {
        let (key, line) = entry?;
        let line = line.as_ref();
        out.write_all(line)?;
        out.write_all(b"\n")?;
        places.insert(key, Place::of(at, line));
        at += line.len() as u64 + 1;
    }
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    let read = file.try_clone()?;
    let mut append = Appender::new(dir, file, at, places.len());
    let journal = dir.join(JOURNAL);
    if keep_old && journal.exists() {
        std::fs::copy(&journal, dir.join(JOURNAL_CORRUPT))?;
    }
    std::fs::rename(&new, &journal)?;
    // The new journal has the name now, whatever happens next: it is the one appended to.
    if let Err(e) = sync_dir(dir) {
        warn!(dir = %dir.display(), "cannot sync the record's directory after a compaction (tried again before the next intent): {e}");
        append.dir_unsynced = true;
    }
    Ok(Compacted {
        places,
        append,
        read,
    })
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Why an append failed.
pub(super) enum AppendError {
    /// Nothing of the batch is in the journal.
    NotWritten(std::io::Error),
    /// The batch is in the journal but may not be on disk.
    NotSynced(std::io::Error),
}

/// The journal's open end, owned by the writer thread.
pub(super) struct Appender {
    dir: PathBuf,
    file: File,
    len: u64,
    lines: usize,
    /// The journal took its name in a rename whose directory sync failed: the next durable
    /// append syncs the directory first (its lines are not durable until the name is).
    dir_unsynced: bool,
    /// Where the space allocated for the journal ends (at least `len`).
    reserved: u64,
    /// The last refill of the reserve failed for want of space.
    short: bool,
}

impl Appender {
    /// Opens the journal in `dir` (made if missing) to append to it; it holds `lines` lines.
    pub(super) fn open(dir: &Path, lines: usize) -> std::io::Result<Self> {
        let path = dir.join(JOURNAL);
        let created = !path.exists();
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        if created {
            sync_dir(dir)?;
        }
        let len = file.metadata()?.len();
        Ok(Appender::new(dir, file, len, lines))
    }

    fn new(dir: &Path, file: File, len: u64, lines: usize) -> Self {
        let mut append = Appender {
            dir: dir.to_path_buf(),
            file,
            len,
            lines,
            dir_unsynced: false,
            reserved: len,
            short: false,
        };
        append.refill();
        append
    }

    /// Whether the journal has its reserve: tops it up to [`RESERVE`] past the end when half
    /// of it is used. Allocating what is already allocated takes no space, so after a restart
    /// the reserve written before is found again even on a full disk. `false` when the disk
    /// has no room for the refill; a filesystem without `fallocate` has no reserve to keep
    /// (and is never short of it).
    pub(super) fn refill(&mut self) -> bool {
        use rustix::fs::{fallocate, FallocateFlags};
        if self.reserved.saturating_sub(self.len) >= RESERVE / 2 {
            return true;
        }
        let was_short = self.short;
        match fallocate(&self.file, FallocateFlags::KEEP_SIZE, self.len, RESERVE) {
            Ok(()) => {
                self.reserved = self.len + RESERVE;
                self.short = false;
                if was_short {
                    info!(dir = %self.dir.display(), "the volume record's reserve is whole again: set-ups resume");
                }
            }
            Err(rustix::io::Errno::NOSPC | rustix::io::Errno::DQUOT) => {
                self.short = true;
                if !was_short {
                    warn!(
                        dir = %self.dir.display(),
                        left = self.reserved.saturating_sub(self.len),
                        "the disk holding the volume record is full: its reserve is kept for teardowns, and set-ups wait for space"
                    );
                }
            }
            Err(e) => {
                // No fallocate here (or another failure): appends take their chance.
                tracing::debug!(dir = %self.dir.display(), "cannot allocate the volume record's reserve: {e}");
                self.reserved = u64::MAX;
            }
        }
        !self.short
    }

    /// The record's directory.
    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the next append begins.
    pub(super) fn end(&self) -> u64 {
        self.len
    }

    /// Appends `buf` (`lines` whole lines) in one write, synced when `durable`. A write that
    /// fails is cut off again, so the next one starts on a line of its own.
    pub(super) fn append(
        &mut self,
        buf: &[u8],
        lines: usize,
        durable: bool,
    ) -> Result<(), AppendError> {
        if let Err(e) = self.file.write_all(buf) {
            let _ = self.file.set_len(self.len);
            return Err(AppendError::NotWritten(e));
        }
        self.len += buf.len() as u64;
        self.reserved = self.reserved.max(self.len);
        self.lines += lines;
        if durable {
            if self.dir_unsynced {
                sync_dir(&self.dir).map_err(AppendError::NotSynced)?;
                self.dir_unsynced = false;
            }
            self.file.sync_data().map_err(AppendError::NotSynced)?;
        }
        Ok(())
    }

    /// Compacts the journal if its lines outgrow twice the `live` records: writes them to a
    /// new journal (read from the old one, in key order), and has `live` and this appender
    /// follow it. A compaction that fails leaves the old journal as it was, still appended to,
    /// and is tried again after as many lines again.
    pub(super) fn maybe_compact(&mut self, live: &std::sync::Mutex<Live>) {
        let (entries, old) = {
            let live = crate::sync::lock(live);
            if self.lines <= 2 * live.len() + COMPACT_SLACK {
                return;
            }
            (live.in_journal_order(), live.file())
        };
        let count = entries.len();
        let mut window = Window::new(&old);
        let lines = entries.into_iter().map(|(key, place)| {
            let line = window.line(place)?.to_vec();
            Ok((key, line))
        });
        match compact(&self.dir, lines, false) {
            Ok(Compacted {
                places,
                append,
                read,
            }) => {
                info!(
                    records = count,
                    dropped = self.lines - count,
                    "record journal compacted"
                );
                *crate::sync::lock(live) = Live::new(places, read);
                *self = append;
            }
            Err(e) => {
                warn!(dir = %self.dir.display(), "cannot compact the record journal: {e}");
                self.lines = count;
            }
        }
    }
}

/// Reads lines of a journal in the order they lie in it, through a window of a few hundred
/// kilobytes: one read for many lines, and no more memory than the window, whatever the
/// journal's size.
struct Window<'a> {
    file: &'a File,
    buf: Vec<u8>,
    /// Where `buf` begins in the file.
    at: u64,
}

impl<'a> Window<'a> {
    const SIZE: usize = 256 << 10;

    fn new(file: &'a File) -> Self {
        Window {
            file,
            buf: Vec::new(),
            at: 0,
        }
    }

    /// The line at `place`, read with the ones after it if it is not in the window.
    fn line(&mut self, place: Place) -> std::io::Result<&[u8]> {
        let len = place.len as usize;
        let inside = place.at >= self.at && (place.at - self.at) as usize + len <= self.buf.len();
        if !inside {
            self.buf.resize(Self::SIZE.max(len), 0);
            let mut got = 0;
            while got < len {
                match self
                    .file
                    .read_at(&mut self.buf[got..], place.at + got as u64)?
                {
                    0 => break,
                    n => got += n,
                }
            }
            self.buf.truncate(got);
            self.at = place.at;
            if got < len {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "a record lies beyond the journal's end",
                ));
            }
        }
        let from = (place.at - self.at) as usize;
        Ok(&self.buf[from..from + len])
    }
}

/// Removes a compaction cut short by a crash (the journal it would have replaced is whole).
pub(super) fn remove_partial(dir: &Path) {
    let _ = std::fs::remove_file(dir.join(JOURNAL_NEW));
}

#[cfg(test)]
mod tests {
    use super::{Place, Window};
    use std::io::Write;

    /// Lines of every size, a few longer than the window among them, read in the journal's
    /// order (some skipped, as dead lines are) are the bytes written, and a place beyond the
    /// end is an error, not a short line.
    #[test]
    fn the_window_reads_each_line_whole_wherever_it_lies() {
        let mut file = tempfile::tempfile().unwrap();
        let mut places = Vec::new();
        let mut at = 0u64;
        for i in 0..3000usize {
            let len = match i % 500 {
                7 => Window::SIZE * 2 + 13,
                _ => 1 + (i * 37) % 900,
            };
            let line: Vec<u8> = (0..len).map(|j| b'a' + ((i + j) % 26) as u8).collect();
            file.write_all(&line).unwrap();
            file.write_all(b"\n").unwrap();
            places.push((Place::of(at, &line), line));
            at += len as u64 + 1;
        }
        let mut window = Window::new(&file);
        for (place, line) in places.iter().filter(|(p, _)| p.at % 3 != 0) {
            assert_eq!(window.line(*place).unwrap(), &line[..], "at {}", place.at);
        }
        let beyond = Place::of(at - 5, b"0123456789");
        assert!(window.line(beyond).is_err());
    }
}
