//! `kubevol bench --fs-group FILES`: a volume of FILES files and directories (directories of
//! 1,000 entries) is given a pod's fsGroup, side by side with the kubelet's own
//! SetVolumeOwnership (built from the pinned `k8s.io/kubernetes` module by
//! `tools/k8s/build-harness.sh`) and a raw single-threaded walk, on the same tree, in the same
//! run: first on a tree none of whose entries has the group (every entry changed), then again
//! on the tree that has it (what `fsGroupChangePolicy: Always` costs at every later set-up), and
//! `OnRootMismatch` with the root already right.

use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use rustix::fs::{AtFlags, FileType, Mode, OFlags};

use super::*;
use kubevol_mount::safe::{Dir, FsGroupPolicy};

/// Entries per directory of the benchmark's tree.
const PER_DIR: usize = 1000;

/// The group the benchmark gives (any group; the tree starts with group 0).
const GID: u32 = 4242;

pub(super) fn open_dir(parent: BorrowedFd<'_>, name: &OsStr) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(
        parent,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// Makes `files` entries below `root`, made now: directories of [`PER_DIR`] entries (each
/// directory counts as one), mode 0755 and 0644, group 0.
fn make_tree(root: &Path, files: usize) -> anyhow::Result<()> {
    std::fs::create_dir(root)?;
    fill_tree(root, files)
}

/// [`make_tree`] in the existing, empty directory `root`.
pub(super) fn fill_tree(root: &Path, files: usize) -> anyhow::Result<()> {
    let top = open_dir(rustix::fs::CWD, root.as_os_str())?;
    let mut made = 0;
    let mut d = 0;
    while made < files {
        let name = format!("d{d}");
        rustix::fs::mkdirat(&top, &name, Mode::from_raw_mode(0o755))?;
        let dir = open_dir(top.as_fd(), OsStr::new(&name))?;
        made += 1;
        for f in 0..PER_DIR.saturating_sub(1).min(files - made) {
            let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC;
            drop(rustix::fs::openat(
                &dir,
                format!("f{f}"),
                flags,
                Mode::from_raw_mode(0o644),
            )?);
            made += 1;
        }
        d += 1;
    }
    Ok(())
}

/// The raw floor: every entry below (and with) `dir` given group `gid` and the modes
/// `dir_mode` and `file_mode` with one stat, one chown and one chmod by name each, relative to
/// the directory's descriptor, with no check of any kind; with `only_stat`, the stat alone (a
/// walk that finds everything right).
pub(super) fn raw_walk(
    dir: BorrowedFd<'_>,
    gid: u32,
    modes: (u32, u32),
    only_stat: bool,
) -> rustix::io::Result<()> {
    let mut stack: Vec<OwnedFd> = vec![rustix::io::dup(dir)?];
    while let Some(d) = stack.pop() {
        for entry in rustix::fs::Dir::read_from(&d)? {
            let entry = entry?;
            let name = entry.file_name();
            if name == c"." || name == c".." {
                continue;
            }
            let st = rustix::fs::statat(&d, name, AtFlags::SYMLINK_NOFOLLOW)?;
            let is_dir = FileType::from_raw_mode(st.st_mode) == FileType::Directory;
            if !only_stat {
                let g = Some(rustix::fs::Gid::from_raw(gid));
                rustix::fs::chownat(&d, name, None, g, AtFlags::SYMLINK_NOFOLLOW)?;
                let mode = if is_dir { modes.0 } else { modes.1 };
                rustix::fs::chmodat(&d, name, Mode::from_raw_mode(mode), AtFlags::empty())?;
            }
            if is_dir {
                stack.push(open_dir(d.as_fd(), OsStr::from_bytes(name.to_bytes()))?);
            }
        }
    }
    Ok(())
}

/// Gives the whole tree back group 0 and modes 0755/0644, as it was made.
fn reset(vol: &Path) -> anyhow::Result<()> {
    let fd = open_dir(rustix::fs::CWD, vol.as_os_str())?;
    rustix::fs::fchown(&fd, None, Some(rustix::fs::Gid::from_raw(0)))?;
    rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o755))?;
    raw_walk(fd.as_fd(), 0, (0o755, 0o644), false).context("reset the benchmark's tree")?;
    Ok(())
}

/// Runs the kubelet harness with `args` and returns what it printed: a line of named figures
/// ("seconds 1.2" or "p50 0.9 p99 1.1 ...").
pub(super) fn run_harness(
    harness: &Path,
    args: &[&std::ffi::OsStr],
) -> anyhow::Result<Vec<(String, f64)>> {
    let out = std::process::Command::new(harness)
        .args(args)
        .output()
        .with_context(|| format!("run {}", harness.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // The end of its log (the kubelet's code logs every volume).
        let log = String::from_utf8_lossy(&out.stderr);
        let tail: String = log
            .chars()
            .rev()
            .take(4000)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        anyhow::bail!(
            "{} {:?} failed: {stdout}{tail}",
            harness.display(),
            args.first()
        );
    }
    let words: Vec<&str> = stdout.split_whitespace().collect();
    words
        .chunks(2)
        .map(|pair| match pair {
            [name, value] => value
                .parse()
                .map(|v| (name.to_string(), v))
                .with_context(|| format!("unexpected output of the harness: {stdout}")),
            _ => anyhow::bail!("unexpected output of the harness: {stdout}"),
        })
        .collect()
}

/// The figure `name` of the harness's output.
pub(super) fn figure(figures: &[(String, f64)], name: &str) -> anyhow::Result<f64> {
    figures
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| *v)
        .with_context(|| format!("the harness printed no {name}: {figures:?}"))
}

/// The kubelet's SetVolumeOwnership as the harness runs it: its own measure of the call, in
/// seconds, or why it could not run.
fn kubelet(harness: &Path, vol: &Path, policy: &str) -> anyhow::Result<f64> {
    let gid = GID.to_string();
    let args = [
        OsStr::new("fsgroup"),
        vol.as_os_str(),
        OsStr::new(&gid),
        OsStr::new(policy),
    ];
    figure(&run_harness(harness, &args)?, "seconds")
}

/// The kubelet harness: `KUBEVOL_KUBELET_HARNESS`, or built by `tools/k8s/build-harness.sh`
/// of the repository the benchmark runs in (Go and the module proxy needed).
pub(super) fn harness() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("KUBEVOL_KUBELET_HARNESS") {
        return Ok(PathBuf::from(p));
    }
    let script = Path::new("tools/k8s/build-harness.sh");
    anyhow::ensure!(
        script.exists(),
        "run the benchmark from the repository (tools/k8s/build-harness.sh builds the kubelet harness), or set KUBEVOL_KUBELET_HARNESS"
    );
    let out = std::process::Command::new(script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("run tools/k8s/build-harness.sh")?;
    anyhow::ensure!(out.status.success(), "tools/k8s/build-harness.sh failed");
    let dir = String::from_utf8_lossy(&out.stdout);
    let dir = dir.lines().last().unwrap_or_default().trim();
    Ok(Path::new(dir).join("kubelet-harness"))
}

/// One figure: seconds and entries per second.
fn rate(entries: usize, seconds: f64) -> String {
    format!(
        "{seconds:8.3} s {:>11.0}/s",
        entries as f64 / seconds.max(1e-9)
    )
}

/// Runs the fsGroup benchmark on `files` entries.
pub fn run(args: &BenchArgs, files: usize) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        files > 0,
        "--fs-group: give the number of files (e.g. 1000000)"
    );
    let harness = harness();
    let (tmp, _) = BenchRoot::new(args)?;
    let vol = tmp.path().join("volume");
    let t = Instant::now();
    make_tree(&vol, files)?;
    println!(
        "kubevol bench --fs-group {files}: {} directories of up to {PER_DIR} entries, group 0 and modes 0755/0644 to begin with",
        files.div_ceil(PER_DIR)
    );
    println!("root: {}", tmp.describe());
    println!(
        "tree made in {:.1} s; each run below starts from the state it names",
        t.elapsed().as_secs_f64()
    );

    let floor = |only_stat: bool| -> anyhow::Result<f64> {
        let fd = open_dir(rustix::fs::CWD, vol.as_os_str())?;
        let t = Instant::now();
        if !only_stat {
            rustix::fs::fchown(&fd, None, Some(rustix::fs::Gid::from_raw(GID)))?;
            rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o2775))?;
        }
        raw_walk(fd.as_fd(), GID, (0o2775, 0o664), only_stat).context("the raw walk")?;
        Ok(t.elapsed().as_secs_f64())
    };
    let kubevol = |policy: FsGroupPolicy| -> anyhow::Result<(f64, bool)> {
        let dir = Dir::open(&vol)?;
        let t = Instant::now();
        let walked = dir.apply_fs_group(GID, false, policy)?;
        Ok((t.elapsed().as_secs_f64(), walked))
    };

    // First time: every entry changed.
    let floor_first = floor(false)?;
    let floor_again = floor(true)?;
    reset(&vol)?;
    let (kv_first, _) = kubevol(FsGroupPolicy::Always)?;
    let (kv_again, _) = kubevol(FsGroupPolicy::Always)?;
    let (kv_root, walked) = kubevol(FsGroupPolicy::OnRootMismatch)?;
    anyhow::ensure!(!walked, "OnRootMismatch walked a tree whose root matches");
    let kubelet_runs = match &harness {
        Ok(h) => {
            reset(&vol)?;
            let first = kubelet(h, &vol, "Always")?;
            let again = kubelet(h, &vol, "Always")?;
            let root = kubelet(h, &vol, "OnRootMismatch")?;
            Some((first, again, root))
        }
        Err(e) => {
            println!("the kubelet's SetVolumeOwnership is not measured: {e:#}");
            None
        }
    };

    println!();
    println!(
        "{:<34} {:<26} {:<26}",
        "", "first time (all changed)", "again (all already right)"
    );
    println!(
        "{:<34} {:<26} {:<26}",
        "raw single-threaded walk (floor)",
        rate(files, floor_first),
        rate(files, floor_again)
    );
    println!(
        "{:<34} {:<26} {:<26}",
        "kubevol",
        rate(files, kv_first),
        rate(files, kv_again)
    );
    println!(
        "  kubevol/floor (time)             {:<26.2} {:<26.2}",
        kv_first / floor_first,
        kv_again / floor_again
    );
    if let Some((first, again, root)) = kubelet_runs {
        println!(
            "{:<34} {:<26} {:<26}",
            "kubelet SetVolumeOwnership",
            rate(files, first),
            rate(files, again)
        );
        println!(
            "  kubevol is faster than the kubelet {:<26} {:<26}",
            format!("{:.2}x", first / kv_first),
            format!("{:.2}x", again / kv_again)
        );
        println!(
            "OnRootMismatch with the root already right: kubevol {:.1} µs, kubelet {:.1} µs (neither walks)",
            kv_root * 1e6,
            root * 1e6
        );
    } else {
        println!(
            "OnRootMismatch with the root already right: kubevol {:.1} µs (no walk)",
            kv_root * 1e6
        );
    }
    tmp.release()?;
    Ok(ExitCode::SUCCESS)
}
