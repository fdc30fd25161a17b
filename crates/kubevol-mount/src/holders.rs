//! Who keeps a mount busy: the processes with a working directory, a root, an open file or a
//! memory map in it, the mounts stacked on top of it, and the namespaces it was propagated
//! into. What `fuser -vm` and `lsof` answer by hand, read from `/proc` within a deadline, and
//! never acting on what it finds.
//!
//! A process in another mount namespace (a container) names its files by its own view: a
//! volume mounted at `/data` there. Its mount table says where the same filesystem (the same
//! device and root) is mounted in its view, so its paths are matched against those places.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::mountinfo::{self, MountInfo};

/// How a process holds a mount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hold {
    /// Its working directory is in it.
    Cwd(PathBuf),
    /// Its root directory is in it (a container's root).
    Root(PathBuf),
    /// It has a file open in it.
    OpenFile(PathBuf),
    /// It maps a file of it into memory.
    Map(PathBuf),
    /// A mount is stacked on top of it (by the process that owns nothing: `pid` 0).
    MountOnTop(PathBuf),
    /// The mount was propagated into the process's mount namespace, at this place there: the
    /// filesystem stays in use while that namespace lives.
    MountInNamespace(PathBuf),
}

/// One holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// The process (0 for a mount stacked in kubevol's own namespace).
    pub pid: u32,
    /// Its command name (`/proc/<pid>/comm`).
    pub command: String,
    /// How it holds the mount.
    pub how: Hold,
}

impl Holder {
    /// Whether the hold ends when the process exits (a file, a directory or a map of its
    /// own; a namespace may outlive it).
    pub fn ends_with_process(&self) -> bool {
        matches!(
            self.how,
            Hold::Cwd(_) | Hold::Root(_) | Hold::OpenFile(_) | Hold::Map(_)
        )
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (what, path) = match &self.how {
            Hold::Cwd(p) => ("cwd", p),
            Hold::Root(p) => ("root", p),
            Hold::OpenFile(p) => ("open file", p),
            Hold::Map(p) => ("memory map", p),
            Hold::MountOnTop(p) => return write!(f, "a mount on top at {}", p.display()),
            Hold::MountInNamespace(p) => ("mount in its namespace at", p),
        };
        write!(
            f,
            "pid {} ({}, {what} {})",
            self.pid,
            self.command,
            path.display()
        )
    }
}

/// What a scan found, and whether it looked at every process before its deadline.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Holders {
    /// The holders found, by process.
    pub holders: Vec<Holder>,
    /// Whether every process was looked at.
    pub complete: bool,
    /// How many processes were looked at.
    pub processes: usize,
}

impl fmt::Display for Holders {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A process with many files in the mount is named once per kind of hold, at most
        // three times.
        let mut shown: HashMap<u32, usize> = HashMap::new();
        let mut parts = Vec::new();
        for h in &self.holders {
            let n = shown.entry(h.pid).or_default();
            *n += 1;
            if *n <= 3 || h.pid == 0 {
                parts.push(h.to_string());
            }
        }
        if parts.is_empty() {
            f.write_str("no process found holding it")?;
        } else {
            write!(f, "held by {}", parts.join(", "))?;
        }
        if !self.complete {
            write!(
                f,
                " (the scan stopped after {} processes at its deadline)",
                self.processes
            )?;
        }
        Ok(())
    }
}

/// Where the filesystem of a mount is mounted in one mount namespace: each place, with the path
/// inside the filesystem it shows.
fn places_in(table: &[MountInfo], dev: &str, root: &Path) -> Vec<(PathBuf, PathBuf)> {
    table
        .iter()
        .filter(|m| m.major_minor == dev)
        .filter_map(|m| {
            // The same part of the filesystem, or a part of it.
            let below = m.root.strip_prefix(root).ok()?;
            Some((m.mount_point.clone(), below.to_path_buf()))
        })
        .collect()
}

/// Whether `path` (as a process sees it) is in the mount, given where the mount's filesystem
/// shows in that process's view.
fn within(path: &Path, places: &[(PathBuf, PathBuf)]) -> bool {
    places.iter().any(|(at, _)| path.starts_with(at))
}

/// The process's command name.
fn command(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Finds who holds the mount at `target` (a mount point in this process's namespace), looking
/// at processes until `deadline`. Nothing found is acted on.
pub fn find(target: &Path, deadline: Instant) -> std::io::Result<Holders> {
    let own_table = mountinfo::parse(&std::fs::read_to_string("/proc/self/mountinfo")?)
        .map_err(std::io::Error::other)?;
    // The top mount at the target.
    let Some(mount) = own_table.iter().rev().find(|m| m.mount_point == target) else {
        return Ok(Holders {
            complete: true,
            ..Holders::default()
        });
    };
    let mut out = Holders {
        complete: true,
        ..Holders::default()
    };
    for m in &own_table {
        if m.parent_id == mount.id || (m.mount_point != target && m.mount_point.starts_with(target))
        {
            out.holders.push(Holder {
                pid: 0,
                command: String::new(),
                how: Hold::MountOnTop(m.mount_point.clone()),
            });
        }
    }
    let own_ns = std::fs::read_link("/proc/self/ns/mnt").ok();
    let own_places = places_in(&own_table, &mount.major_minor, &mount.root);
    // Mount tables of other namespaces, read once each.
    let mut tables: HashMap<PathBuf, Option<Vec<(PathBuf, PathBuf)>>> = HashMap::new();
    let mut namespaces_named: std::collections::HashSet<PathBuf> = Default::default();
    for entry in std::fs::read_dir("/proc")? {
        if Instant::now() >= deadline {
            out.complete = false;
            break;
        }
        let Ok(entry) = entry else { continue };
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        out.processes += 1;
        let proc_dir = entry.path();
        let ns = std::fs::read_link(proc_dir.join("ns/mnt")).ok();
        let places: Vec<(PathBuf, PathBuf)> = if ns.is_none() || ns == own_ns {
            own_places.clone()
        } else {
            let ns = ns.clone().unwrap_or_default();
            let cached = tables.entry(ns.clone()).or_insert_with(|| {
                let text = std::fs::read_to_string(proc_dir.join("mountinfo")).ok()?;
                let table = mountinfo::parse(&text).ok()?;
                Some(places_in(&table, &mount.major_minor, &mount.root))
            });
            let places = cached.clone().unwrap_or_default();
            if !places.is_empty() && namespaces_named.insert(ns) {
                out.holders.push(Holder {
                    pid,
                    command: command(pid),
                    how: Hold::MountInNamespace(places[0].0.clone()),
                });
            }
            places
        };
        if places.is_empty() {
            continue;
        }
        let mut found = Vec::new();
        for (link, make) in [
            ("cwd", Hold::Cwd as fn(PathBuf) -> Hold),
            ("root", Hold::Root),
        ] {
            if let Ok(p) = std::fs::read_link(proc_dir.join(link)) {
                // Every process's root is `/`; only a root inside the mount counts.
                if within(&p, &places) && !(link == "root" && p == Path::new("/")) {
                    found.push(make(p));
                }
            }
        }
        if let Ok(fds) = std::fs::read_dir(proc_dir.join("fd")) {
            for fd in fds.flatten() {
                if let Ok(p) = std::fs::read_link(fd.path()) {
                    if within(&p, &places) {
                        found.push(Hold::OpenFile(p));
                    }
                }
            }
        }
        if let Ok(maps) = std::fs::read_to_string(proc_dir.join("maps")) {
            let mut seen = std::collections::HashSet::new();
            for line in maps.lines() {
                // address perms offset dev inode path
                let path = line.split_whitespace().nth(5).map(PathBuf::from);
                if let Some(p) = path.filter(|p| within(p, &places)) {
                    if seen.insert(p.clone()) {
                        found.push(Hold::Map(p));
                    }
                }
            }
        }
        if !found.is_empty() {
            let command = command(pid);
            out.holders.extend(found.into_iter().map(|how| Holder {
                pid,
                command: command.clone(),
                how,
            }));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_are_named_once_per_kind_and_an_incomplete_scan_says_so() {
        let h = |pid, how| Holder {
            pid,
            command: "postgres".into(),
            how,
        };
        let found = Holders {
            holders: vec![
                h(4711, Hold::Cwd("/v/data".into())),
                h(4711, Hold::OpenFile("/v/data/a".into())),
                h(4711, Hold::OpenFile("/v/data/b".into())),
                h(4711, Hold::OpenFile("/v/data/c".into())),
                Holder {
                    pid: 0,
                    command: String::new(),
                    how: Hold::MountOnTop("/v/data/sub".into()),
                },
            ],
            complete: false,
            processes: 5000,
        };
        assert_eq!(
            found.to_string(),
            "held by pid 4711 (postgres, cwd /v/data), pid 4711 (postgres, open file /v/data/a), pid 4711 (postgres, open file /v/data/b), a mount on top at /v/data/sub (the scan stopped after 5000 processes at its deadline)"
        );
        assert!(found.holders[0].ends_with_process());
        assert!(!found.holders[4].ends_with_process());
    }

    #[test]
    fn a_path_is_within_the_places_its_filesystem_shows() {
        let table = mountinfo::parse(
            "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n\
             30 1 0:50 / /var/lib/kubevol/pods/u/volumes/v rw - tmpfs tmpfs rw\n\
             40 1 0:50 /sub /data rw - tmpfs tmpfs rw\n",
        )
        .unwrap();
        let places = places_in(&table, "0:50", Path::new("/"));
        assert_eq!(places.len(), 2);
        assert!(within(Path::new("/data/x"), &places));
        assert!(within(
            Path::new("/var/lib/kubevol/pods/u/volumes/v/y"),
            &places
        ));
        assert!(!within(
            Path::new("/var/lib/kubevol/pods/u/volumes/w"),
            &places
        ));
        assert!(places_in(&table, "0:50", Path::new("/other")).is_empty());
    }
}
