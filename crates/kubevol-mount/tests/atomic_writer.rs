//! The atomic writer on a real filesystem: layout, updates, fsGroup, hostile links, and a writer
//! killed with SIGKILL at every step. Nothing here mounts; the directories are temporary.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use kubevol_mount::atomic::{self, Entry, Ownership, Step, Written};
use kubevol_mount::safe::Dir;
use kubevol_mount::MountError;

type Files = BTreeMap<&'static str, (&'static str, u32)>;

fn as_entries(files: &Files) -> Vec<Entry<'_>> {
    files
        .iter()
        .map(|(p, (data, mode))| Entry {
            path: p,
            data: data.as_bytes(),
            mode: *mode,
            user: None,
        })
        .collect()
}

fn write(dir: &Path, files: &Files, own: Ownership) -> Result<Written, MountError> {
    let d = Dir::open(dir).expect("open volume dir");
    atomic::write(&d, &as_entries(files), own, &mut |_| {})
}

fn v1() -> Files {
    BTreeMap::from([
        ("a", ("alpha", 0o644)),
        ("dir/b", ("beta", 0o600)),
        ("dir/sub/c", ("gamma", 0o400)),
    ])
}

fn v2() -> Files {
    BTreeMap::from([("dir/b", ("beta 2", 0o600)), ("new", ("fresh", 0o644))])
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn payload_dirs(dir: &Path) -> Vec<String> {
    entries(dir)
        .into_iter()
        .filter(|n| atomic::is_payload_dir_name(n.as_bytes()))
        .collect()
}

/// Checks the converged state: exactly `files` visible through `..data`, one payload directory,
/// no `..data_tmp`, every top-level entry a link into `..data`.
fn assert_converged(dir: &Path, files: &Files) {
    let data = fs::read_link(dir.join("..data")).expect("..data is a link");
    let payloads = payload_dirs(dir);
    assert_eq!(
        payloads,
        vec![data.to_string_lossy().into_owned()],
        "one payload directory, the current one"
    );
    assert!(
        !dir.join("..data_tmp").exists() && fs::symlink_metadata(dir.join("..data_tmp")).is_err(),
        "no ..data_tmp"
    );
    let mut top: Vec<String> = files
        .keys()
        .map(|p| p.split('/').next().unwrap().to_string())
        .collect();
    top.dedup();
    for t in &top {
        assert_eq!(
            fs::read_link(dir.join(t)).unwrap(),
            PathBuf::from(format!("..data/{t}")),
            "visible link {t}"
        );
    }
    let visible: Vec<String> = entries(dir)
        .into_iter()
        .filter(|n| !n.starts_with(".."))
        .collect();
    assert_eq!(visible, top, "no other visible entries");
    for (p, (content, mode)) in files {
        assert_eq!(fs::read_to_string(dir.join(p)).unwrap(), *content, "{p}");
        let m = fs::metadata(dir.join(p)).unwrap().permissions().mode() & 0o7777;
        assert_eq!(m, *mode, "mode of {p}");
    }
}

#[test]
fn layout_update_and_unchanged() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    assert_eq!(
        write(dir, &v1(), Ownership::default()).unwrap(),
        Written::Updated
    );
    assert_converged(dir, &v1());
    let first = fs::read_link(dir.join("..data")).unwrap();
    assert_eq!(
        write(dir, &v1(), Ownership::default()).unwrap(),
        Written::Unchanged
    );
    assert_eq!(
        fs::read_link(dir.join("..data")).unwrap(),
        first,
        "unchanged content is not rewritten"
    );
    assert_eq!(
        write(dir, &v2(), Ownership::default()).unwrap(),
        Written::Updated
    );
    assert_converged(dir, &v2());
    assert!(
        fs::symlink_metadata(dir.join("a")).is_err(),
        "a removed key's link is gone"
    );
    assert_eq!(
        write(dir, &Files::new(), Ownership::default()).unwrap(),
        Written::Updated
    );
    assert_converged(dir, &Files::new());
}

/// Content of the same size, a mode, a file too many or too few on disk: each is a difference
/// and the payload is written again; only the same files with the same content and modes are
/// left alone.
#[test]
fn every_kind_of_difference_is_written_again() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let own = Ownership::default();
    write(dir, &v1(), own).unwrap();
    let with = |path: &'static str, data: &'static str, mode: u32| {
        let mut f = v1();
        f.insert(path, (data, mode));
        f
    };
    let same_size = with("a", "alphA", 0o644);
    assert_eq!(write(dir, &same_size, own).unwrap(), Written::Updated);
    assert_converged(dir, &same_size);
    assert_eq!(write(dir, &same_size, own).unwrap(), Written::Unchanged);
    let mode = with("a", "alphA", 0o640);
    assert_eq!(write(dir, &mode, own).unwrap(), Written::Updated);
    assert_converged(dir, &mode);
    assert_eq!(write(dir, &mode, own).unwrap(), Written::Unchanged);

    let payload = dir.join(fs::read_link(dir.join("..data")).unwrap());
    fs::write(payload.join("dir/sub/extra"), "x").unwrap();
    assert_eq!(
        write(dir, &mode, own).unwrap(),
        Written::Updated,
        "a file too many"
    );
    assert_converged(dir, &mode);
    let payload = dir.join(fs::read_link(dir.join("..data")).unwrap());
    fs::remove_file(payload.join("dir/b")).unwrap();
    assert_eq!(
        write(dir, &mode, own).unwrap(),
        Written::Updated,
        "a file too few"
    );
    assert_converged(dir, &mode);
    assert_eq!(write(dir, &mode, own).unwrap(), Written::Unchanged);
}

#[test]
fn fs_group_sets_group_and_read_bits() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path();
    let own = Ownership { gid: Some(4321) };
    write(dir, &v1(), own).unwrap();
    let f = fs::metadata(dir.join("dir/sub/c")).unwrap();
    assert_eq!(
        (f.gid(), f.mode() & 0o7777),
        (4321, 0o440),
        "0400 becomes 0440 for the group"
    );
    let d = fs::metadata(dir.join("..data/dir")).unwrap();
    assert_eq!(
        (d.gid(), d.mode() & 0o7777),
        (4321, 0o2755),
        "directories: group, search, set-group-ID"
    );
    assert_eq!(write(dir, &v1(), own).unwrap(), Written::Unchanged);
    assert_eq!(
        write(dir, &v1(), Ownership { gid: Some(99) }).unwrap(),
        Written::Updated,
        "a new group rewrites"
    );
    assert_eq!(fs::metadata(dir.join("a")).unwrap().gid(), 99);
}

/// A directory outside the volume with a canary, and a check that nothing in it changed.
struct Outside {
    _t: tempfile::TempDir,
    path: PathBuf,
}

impl Outside {
    fn new() -> Self {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().to_path_buf();
        fs::create_dir(path.join("dir")).unwrap();
        fs::write(path.join("canary"), "do not touch").unwrap();
        fs::write(path.join("dir/b"), "outside b").unwrap();
        fs::set_permissions(path.join("canary"), fs::Permissions::from_mode(0o600)).unwrap();
        Outside { _t: t, path }
    }

    fn assert_untouched(&self) {
        assert_eq!(entries(&self.path), vec!["canary", "dir"]);
        assert_eq!(entries(&self.path.join("dir")), vec!["b"]);
        assert_eq!(
            fs::read_to_string(self.path.join("canary")).unwrap(),
            "do not touch"
        );
        assert_eq!(
            fs::read_to_string(self.path.join("dir/b")).unwrap(),
            "outside b"
        );
        let m = fs::metadata(self.path.join("canary")).unwrap();
        assert_eq!((m.mode() & 0o7777, m.gid()), (0o600, 0));
    }
}

fn assert_unsafe(r: Result<Written, MountError>, what: &str) -> String {
    match r {
        Err(e @ MountError::Unsafe { .. }) => e.to_string(),
        other => panic!("{what}: expected a refusal, got {other:?}"),
    }
}

#[test]
fn planted_links_are_refused_and_nothing_outside_is_touched() {
    let outside = Outside::new();
    let own = Ownership { gid: Some(4321) };

    // ..data pointing outside the volume.
    let t = tempfile::tempdir().unwrap();
    write(t.path(), &v1(), own).unwrap();
    fs::remove_file(t.path().join("..data")).unwrap();
    std::os::unix::fs::symlink(&outside.path, t.path().join("..data")).unwrap();
    let e = assert_unsafe(write(t.path(), &v2(), own), "..data planted");
    assert!(
        e.contains("..data: points to") && e.contains("not to a payload directory of this volume"),
        "{e}"
    );
    // ..data pointing at something shaped like a payload name that is a link.
    fs::remove_file(t.path().join("..data")).unwrap();
    std::os::unix::fs::symlink("..2020_01_01_00_00_00.1", t.path().join("..data")).unwrap();
    std::os::unix::fs::symlink(&outside.path, t.path().join("..2020_01_01_00_00_00.1")).unwrap();
    assert_unsafe(write(t.path(), &v2(), own), "payload dir is a link");
    outside.assert_untouched();

    // A visible key replaced by a link to a file outside.
    let t = tempfile::tempdir().unwrap();
    write(t.path(), &v1(), own).unwrap();
    fs::remove_file(t.path().join("a")).unwrap();
    std::os::unix::fs::symlink(outside.path.join("canary"), t.path().join("a")).unwrap();
    let e = assert_unsafe(write(t.path(), &v1(), own), "visible key planted");
    assert!(
        e.contains("is a symbolic link to") && e.contains("not to \"..data/a\""),
        "{e}"
    );
    let mut changed = v1();
    changed.insert("a", ("alpha 2", 0o644));
    assert_unsafe(
        write(t.path(), &changed, own),
        "visible key planted, on update",
    );
    // A payload without the key leaves the planted link alone: not followed, not removed.
    assert_eq!(write(t.path(), &v2(), own).unwrap(), Written::Updated);
    assert_eq!(
        fs::read_link(t.path().join("a")).unwrap(),
        outside.path.join("canary")
    );
    outside.assert_untouched();

    // An intermediate directory of an item path, inside the payload, replaced by a link.
    let t = tempfile::tempdir().unwrap();
    write(t.path(), &v1(), own).unwrap();
    let payload = t
        .path()
        .join(fs::read_link(t.path().join("..data")).unwrap());
    fs::remove_dir_all(payload.join("dir")).unwrap();
    std::os::unix::fs::symlink(outside.path.join("dir"), payload.join("dir")).unwrap();
    let e = assert_unsafe(write(t.path(), &v1(), own), "intermediate dir planted");
    assert!(
        e.contains("is a symbolic link inside a payload directory"),
        "{e}"
    );
    assert_unsafe(
        write(t.path(), &v2(), own),
        "intermediate dir planted, on update",
    );
    outside.assert_untouched();

    // ..data_tmp as a real directory with data: never removed.
    let t = tempfile::tempdir().unwrap();
    write(t.path(), &v1(), own).unwrap();
    fs::create_dir(t.path().join("..data_tmp")).unwrap();
    fs::write(t.path().join("..data_tmp/keep"), "x").unwrap();
    assert_unsafe(write(t.path(), &v2(), own), "..data_tmp planted");
    assert_eq!(
        fs::read_to_string(t.path().join("..data_tmp/keep")).unwrap(),
        "x"
    );
    outside.assert_untouched();
}

const CRASH_AT: &str = "KUBEVOL_TEST_CRASH_AT";
const CRASH_DIR: &str = "KUBEVOL_TEST_CRASH_DIR";

/// In the child: write v2, and SIGKILL ourselves at hook call number `n`.
fn crash_child() -> bool {
    let (Ok(n), Ok(dir)) = (std::env::var(CRASH_AT), std::env::var(CRASH_DIR)) else {
        return false;
    };
    let n: usize = n.parse().unwrap();
    let d = Dir::open(Path::new(&dir)).unwrap();
    let files = v2();
    let entries = as_entries(&files);
    let mut calls = 0;
    let mut hook = |_step: Step| {
        calls += 1;
        if calls == n {
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL)
                .unwrap();
        }
    };
    atomic::write(&d, &entries, Ownership::default(), &mut hook).unwrap();
    true
}

#[test]
fn killed_at_every_step_converges_on_the_next_write() {
    if crash_child() {
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut killed = 0;
    for n in 1.. {
        let t = tempfile::tempdir().unwrap();
        write(t.path(), &v1(), Ownership::default()).unwrap();
        let status = std::process::Command::new(&exe)
            .args([
                "killed_at_every_step_converges_on_the_next_write",
                "--exact",
                "--test-threads",
                "1",
            ])
            .env(CRASH_AT, n.to_string())
            .env(CRASH_DIR, t.path())
            .output()
            .unwrap()
            .status;
        use std::os::unix::process::ExitStatusExt;
        if status.signal() != Some(9) {
            assert!(
                status.success(),
                "the child failed without being killed at step {n}: {status:?}"
            );
            assert_converged(t.path(), &v2());
            break;
        }
        killed += 1;
        // A reader between the crash and the next write sees one whole version.
        let seen = fs::read_to_string(t.path().join("dir/b")).unwrap();
        assert!(
            seen == "beta" || seen == "beta 2",
            "after a kill at step {n}: {seen:?}"
        );
        write(t.path(), &v2(), Ownership::default()).unwrap();
        assert_converged(t.path(), &v2());
    }
    assert!(killed >= 9, "every step was a kill point ({killed})");
    eprintln!("writer killed at {killed} points, converged each time");
}

/// A payload of many deep paths holds one descriptor per level of the path being written, not
/// one per directory it makes (60 items of 300 levels held 18,000), and a path deeper than the
/// limit is refused before anything is made.
#[test]
fn deep_payloads_hold_a_descriptor_per_level_and_the_limit_is_kept() {
    let t = tempfile::tempdir().unwrap();
    let paths: Vec<String> = (0..60)
        .map(|i| format!("{}f", format!("d{i}/").repeat(atomic::MAX_DEPTH - 1)))
        .collect();
    let entries: Vec<Entry<'_>> = paths
        .iter()
        .map(|p| Entry {
            path: p,
            data: b"v",
            mode: 0o644,
            user: None,
        })
        .collect();
    // Only the descriptors of this test's directory (other tests run beside it).
    let here = fs::canonicalize(t.path()).unwrap();
    let open = || {
        fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| fs::read_link(e.ok()?.path()).ok())
            .filter(|target| target.starts_with(&here))
            .count()
    };
    let before = open();
    let mut most = 0;
    let d = Dir::open(t.path()).unwrap();
    atomic::write(&d, &entries, Ownership { gid: None }, &mut |s| {
        if s == Step::FileWritten {
            most = most.max(open());
        }
    })
    .unwrap();
    assert!(
        most <= before + atomic::MAX_DEPTH + 4,
        "{most} descriptors open while writing, {before} before"
    );
    assert_eq!(
        fs::read_to_string(t.path().join(&paths[59])).unwrap(),
        "v",
        "written through ..data"
    );
    let deeper = format!("{}f", "d/".repeat(atomic::MAX_DEPTH));
    let e = atomic::write(
        &d,
        &[Entry {
            path: &deeper,
            data: b"v",
            mode: 0o644,
            user: None,
        }],
        Ownership { gid: None },
        &mut |_| {},
    )
    .unwrap_err();
    assert!(matches!(e, MountError::NotRelative { .. }), "{e}");
}
