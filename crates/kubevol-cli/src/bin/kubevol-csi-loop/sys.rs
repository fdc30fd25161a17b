//! What the driver does to the node: sparse files, loop devices, filesystems, mounts.
//!
//! Loop devices and filesystems are handled by util-linux and e2fsprogs (`losetup`, `blkid`,
//! `mkfs.<type>`, `resize2fs`), as CSI drivers do; mounts are made with mount(2) directly.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kubevol_mount::{LinuxMounter, Mounter, Unmounted};
use rustix::mount::{MountFlags, MountPropagationFlags};

/// Runs a command; its stderr is the error.
pub fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The loop devices backed by `file`.
pub fn loops_of(file: &Path) -> Result<Vec<String>, String> {
    let out = run("losetup", &["--associated", &file.to_string_lossy()])?;
    Ok(out
        .lines()
        .filter_map(|l| l.split(':').next())
        .map(str::to_string)
        .collect())
}

/// The loop devices whose backing file lies under `dir`, whatever its name now (renamed, or
/// removed: the kernel shows it with ` (deleted)`).
pub fn loops_under(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        let Ok(backing) = std::fs::read_to_string(e.path().join("loop/backing_file")) else {
            continue;
        };
        let backing = backing.trim_end_matches('\n');
        let backing = backing.strip_suffix(" (deleted)").unwrap_or(backing);
        if Path::new(backing).starts_with(dir) {
            out.push(format!("/dev/{name}"));
        }
    }
    out
}

/// The loop device backed by `file`, attached if there is none.
pub fn attach(file: &Path) -> Result<String, String> {
    if let Some(dev) = loops_of(file)?.into_iter().next() {
        return Ok(dev);
    }
    run("losetup", &["--find", "--show", &file.to_string_lossy()])
}

/// Detaches every loop device backed by `file`. A device still in use (mounted, or open
/// elsewhere) is only marked to be freed at its last close: this returns at once, and the
/// device goes with its last user (the cleanup of `--detach-all`, with mounts that vanish
/// with their namespace afterwards).
pub fn detach(file: &Path) -> Result<Vec<String>, String> {
    let devices = loops_of(file)?;
    for dev in &devices {
        run("losetup", &["--detach", dev])?;
    }
    Ok(devices)
}

/// How long a detached loop device may stay bound while something else still holds it.
const DETACH_TIMEOUT: Duration = Duration::from_secs(10);

/// Detaches every loop device backed by `file`, and returns once the kernel has freed them:
/// a volume must not look attached once its unpublish has succeeded, and a device open
/// elsewhere at the detach (udev probing a device attached a moment ago, say) stays bound to
/// `file` until its last close. Still bound after [`DETACH_TIMEOUT`], it is an error (the
/// caller retries).
pub fn detach_freed(file: &Path) -> Result<(), String> {
    let devices = detach(file)?;
    // Bound while its `loop` directory is in sysfs. The kernel's change uevent at the free
    // would need a netlink listener in the driver: sysfs is looked at every 10 ms instead, for
    // the few milliseconds an unpublish waits.
    let bound = |dev: &&String| {
        let name = dev.rsplit('/').next().unwrap_or(dev);
        Path::new("/sys/block")
            .join(name)
            .join("loop/backing_file")
            .exists()
    };
    let deadline = Instant::now() + DETACH_TIMEOUT;
    loop {
        let left: Vec<&str> = devices.iter().filter(bound).map(String::as_str).collect();
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            let left = left.join(" ");
            return Err(format!(
                "{} is still bound to {left} {}s after its detach: something else holds it open \
                 (`fuser -vm {left}` shows what; it is freed at its last close, and the call is \
                 retried)",
                file.display(),
                DETACH_TIMEOUT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The filesystem type on a device, if it has one.
pub fn fs_type(device: &str) -> Result<Option<String>, String> {
    let out = Command::new("blkid")
        .args(["-p", "-s", "TYPE", "-o", "value", device])
        .output()
        .map_err(|e| format!("cannot run blkid: {e}"))?;
    match out.status.code() {
        Some(0) => {
            let t = String::from_utf8_lossy(&out.stdout).trim().to_string();
            Ok((!t.is_empty()).then_some(t))
        }
        // 2: nothing recognised on the device.
        Some(2) => Ok(None),
        _ => Err(format!(
            "blkid {device}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

/// Formats `device` with `fs` unless it already has a filesystem, which must then be `fs`.
pub fn ensure_formatted(device: &str, fs: &str) -> Result<(), String> {
    match fs_type(device)? {
        Some(existing) if existing == fs => Ok(()),
        Some(existing) => Err(format!(
            "{device} already holds a {existing} filesystem, not {fs}; it is not reformatted"
        )),
        None => {
            let mkfs = format!("mkfs.{fs}");
            let mut args = vec![device];
            if fs == "xfs" {
                args = vec!["-q", device];
            } else if fs.starts_with("ext") {
                // No lazy init: the format is complete when mkfs returns.
                args = vec![
                    "-q",
                    "-F",
                    "-E",
                    "lazy_itable_init=0,lazy_journal_init=0",
                    device,
                ];
            }
            run(&mkfs, &args).map(drop)
        }
    }
}

/// Grows the filesystem on `device` to fill it.
pub fn grow_fs(device: &str, mount_point: &Path) -> Result<(), String> {
    match fs_type(device)?.as_deref() {
        Some(t) if t.starts_with("ext") => run("resize2fs", &[device]).map(drop),
        Some("xfs") => run("xfs_growfs", &[&mount_point.to_string_lossy()]).map(drop),
        Some(other) => Err(format!("cannot grow a {other} filesystem")),
        None => Ok(()),
    }
}

/// The source device of the mount at `path`, if `path` is a mount point (the topmost mount).
pub fn mounted_at(path: &Path) -> Result<Option<String>, String> {
    let table = LinuxMounter.mount_table().map_err(|e| e.to_string())?;
    Ok(table
        .into_iter()
        .rev()
        .find(|m| m.mount_point == path)
        .map(|m| m.source))
}

/// Mounts `device` (a filesystem of type `fs`) at `target`.
pub fn mount_fs(
    device: &str,
    target: &Path,
    fs: &str,
    options: &[String],
    ro: bool,
) -> Result<(), String> {
    let mut flags = MountFlags::empty();
    let mut data = Vec::new();
    // SELinux context options on a kernel without SELinux are dropped, as libmount built with
    // SELinux support drops them (the kernel would refuse the mount); the call log keeps what
    // was asked.
    let selinux = Path::new("/sys/fs/selinux/enforce").exists();
    for o in options {
        let context = ["context=", "fscontext=", "defcontext=", "rootcontext="]
            .iter()
            .any(|p| o.starts_with(p));
        if context && !selinux {
            tracing::info!(option = %o, "the kernel has no SELinux: mount option dropped");
            continue;
        }
        match o.as_str() {
            "ro" => flags |= MountFlags::RDONLY,
            "rw" | "defaults" => {}
            "noexec" => flags |= MountFlags::NOEXEC,
            "nosuid" => flags |= MountFlags::NOSUID,
            "nodev" => flags |= MountFlags::NODEV,
            "noatime" => flags |= MountFlags::NOATIME,
            "sync" => flags |= MountFlags::SYNCHRONOUS,
            other => data.push(other),
        }
    }
    if ro {
        flags |= MountFlags::RDONLY;
    }
    let data = std::ffi::CString::new(data.join(","))
        .map_err(|_| "mount options contain a NUL byte".to_string())?;
    rustix::mount::mount(device, target, fs, flags, Some(data.as_c_str()))
        .map_err(|e| format!("mount {device} on {}: {e}", target.display()))
}

/// Bind-mounts `source` at `target`, read-only when asked.
pub fn bind(source: &Path, target: &Path, ro: bool) -> Result<(), String> {
    rustix::mount::mount_bind(source, target)
        .map_err(|e| format!("bind {} on {}: {e}", source.display(), target.display()))?;
    // A private mount: nothing mounted later under the source leaks into the pod.
    let _ = rustix::mount::mount_change(target, MountPropagationFlags::PRIVATE);
    if ro {
        rustix::mount::mount_remount(target, MountFlags::BIND | MountFlags::RDONLY, "")
            .map_err(|e| format!("remount {} read-only: {e}", target.display()))?;
    }
    Ok(())
}

/// Unmounts every mount stacked at `target` (nothing if it is not a mount point).
pub fn unmount_all(target: &Path) -> Result<(), String> {
    if std::fs::symlink_metadata(target).is_err() {
        return Ok(());
    }
    while LinuxMounter.unmount(target).map_err(|e| e.to_string())? == Unmounted::Done {}
    Ok(())
}

/// Removes a target path (directory or file) if it exists and nothing is mounted on it.
pub fn remove_target(target: &Path) -> Result<(), String> {
    match std::fs::symlink_metadata(target) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("{}: {e}", target.display())),
        Ok(m) if m.is_dir() => {
            std::fs::remove_dir(target).map_err(|e| format!("rmdir {}: {e}", target.display()))
        }
        Ok(_) => {
            std::fs::remove_file(target).map_err(|e| format!("remove {}: {e}", target.display()))
        }
    }
}

/// statvfs of a mounted volume: (bytes total, available, used, inodes total, free, used).
pub fn usage(path: &Path) -> Result<[i64; 6], String> {
    let s = rustix::fs::statvfs(path).map_err(|e| format!("statvfs {}: {e}", path.display()))?;
    let f = s.f_frsize as i64;
    let total = s.f_blocks as i64 * f;
    let avail = s.f_bavail as i64 * f;
    let used = (s.f_blocks as i64 - s.f_bfree as i64) * f;
    let itotal = s.f_files as i64;
    let ifree = s.f_ffree as i64;
    Ok([total, avail, used, itotal, ifree, itotal - ifree])
}

/// A device's size in bytes.
pub fn device_size(device: &str) -> Result<i64, String> {
    run("blockdev", &["--getsize64", device])?
        .parse()
        .map_err(|e| format!("blockdev {device}: {e}"))
}

/// Where a volume's backing file lives.
/// A volume's file: `<id>.img`, with each `/` of the ID (cloud-style handles such as
/// `projects/p/zones/z/disks/d`) written as `~`, which IDs cannot contain.
pub fn image(data_dir: &Path, id: &str) -> PathBuf {
    data_dir
        .join("volumes")
        .join(format!("{}.img", id.replace('/', "~")))
}
