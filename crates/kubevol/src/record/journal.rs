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

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
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
        Ok(serde_json::to_vec(self)
            .map_err(std::io::Error::other)?
            .into())
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

/// The live records: each key's latest line (a record, never a removal).
pub(super) type Live = HashMap<Key, Arc<[u8]>>;

/// Parses one line, checking the records' format version.
pub(super) fn parse(line: &[u8]) -> Result<Line, String> {
    let parsed: Line = serde_json::from_slice(line).map_err(|e| e.to_string())?;
    let version = match &parsed {
        Line::PodVolume(r) => r.version,
        Line::Device(r) => r.version,
        _ => super::VERSION,
    };
    if version != super::VERSION {
        return Err(format!(
            "format version {version} is not {}, the one this kubevol writes",
            super::VERSION
        ));
    }
    Ok(parsed)
}

/// The journal as read.
pub(super) struct Read {
    pub live: Live,
    pub corrupt: Vec<CorruptRecord>,
    /// Lines in the file.
    pub lines: usize,
    /// Whether the file needs rewriting (a torn or corrupt line, or too many dead ones).
    pub needs_compaction: bool,
}

/// Reads the journal at `path` on top of `live` (the records of the earlier layout).
pub(super) fn read(path: &Path, mut live: Live) -> std::io::Result<Read> {
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
    let mut bad: Vec<(usize, String)> = Vec::new();
    let mut last_good = 0;
    for (i, piece) in pieces.iter().enumerate() {
        if piece.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match parse(piece) {
            Ok(line) => {
                last_good = i + 1;
                let key = line.key();
                if line.is_removal() {
                    live.remove(&key);
                } else {
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
            pod: None,
            volume: None,
            error,
        });
    }
    let lines = pieces.len();
    needs_compaction |= lines > 2 * live.len() + COMPACT_SLACK;
    Ok(Read {
        live,
        corrupt,
        lines,
        needs_compaction,
    })
}

/// Writes `live` as a new journal in `dir`, synced, and renames it into place (keeping the
/// journal as it was as `journal.corrupt` when `keep_old`).
pub(super) fn compact<'a>(
    dir: &Path,
    live: impl Iterator<Item = &'a Arc<[u8]>>,
    keep_old: bool,
) -> std::io::Result<()> {
    let new = dir.join(JOURNAL_NEW);
    let mut out = BufWriter::new(File::create(&new)?);
    for line in live {
        out.write_all(line)?;
        out.write_all(b"\n")?;
    }
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    drop(file);
    let journal = dir.join(JOURNAL);
    if keep_old && journal.exists() {
        std::fs::copy(&journal, dir.join(JOURNAL_CORRUPT))?;
    }
    std::fs::rename(&new, &journal)?;
    sync_dir(dir)
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
        Ok(Appender {
            dir: dir.to_path_buf(),
            file,
            len,
            lines,
        })
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
        self.lines += lines;
        if durable {
            self.file.sync_data().map_err(AppendError::NotSynced)?;
        }
        Ok(())
    }

    /// Compacts the journal if its lines outgrow twice the `live` records; `snapshot` gives
    /// them (taken only then).
    pub(super) fn maybe_compact(&mut self, live: usize, snapshot: impl FnOnce() -> Vec<Arc<[u8]>>) {
        if self.lines <= 2 * live + COMPACT_SLACK {
            return;
        }
        let records = snapshot();
        let reopened = compact(&self.dir, records.iter(), false)
            .and_then(|()| Appender::open(&self.dir, records.len()));
        match reopened {
            Ok(fresh) => {
                info!(
                    records = records.len(),
                    dropped = self.lines - records.len(),
                    "record journal compacted"
                );
                *self = fresh;
            }
            Err(e) => {
                // The old journal is intact and still appended to; try again after as many
                // lines again.
                warn!(dir = %self.dir.display(), "cannot compact the record journal: {e}");
                self.lines = live;
            }
        }
    }
}

/// Removes a compaction cut short by a crash (the journal it would have replaced is whole).
pub(super) fn remove_partial(dir: &Path) {
    let _ = std::fs::remove_file(dir.join(JOURNAL_NEW));
}
