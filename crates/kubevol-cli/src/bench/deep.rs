//! `kubevol bench --deep-tree LEVELS`: a chain of LEVELS directories, each with a file, as a
//! pod can make in its emptyDir; timed through each of kubevol's walks of it (its usage, the
//! fsGroup walk, and a teardown's two: the one-filesystem check and the removal), beside
//! `rm -rf` of the same tree, with the walks' peak resident memory. A walk is linear in the
//! tree: 1,000,000 levels cost seconds, not minutes.

use super::*;
use kubevol_mount::safe::Dir;

/// Makes a chain of `levels` directories `d` below `top`, each with a file `f`, relative to
/// each level's descriptor (no path is ever that long).
fn chain(top: &Path, levels: usize) -> anyhow::Result<()> {
    use rustix::fs::{Mode, OFlags};
    let dir = OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC;
    let mut cur = rustix::fs::open(top, dir, Mode::empty())?;
    for _ in 0..levels {
        rustix::fs::mkdirat(&cur, "d", Mode::from_raw_mode(0o755))?;
        let f = OFlags::CREATE | OFlags::WRONLY | OFlags::CLOEXEC;
        drop(rustix::fs::openat(
            &cur,
            "f",
            f,
            Mode::from_raw_mode(0o644),
        )?);
        cur = rustix::fs::openat(&cur, "d", dir, Mode::empty())?;
    }
    Ok(())
}

/// Runs the deep-tree benchmark on a chain of `levels`.
pub fn run(args: &BenchArgs, levels: usize) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        levels > 0,
        "--deep-tree: give the number of levels (e.g. 1000000)"
    );
    let (tmp, _) = BenchRoot::new(args)?;
    println!("kubevol bench --deep-tree {levels}: a chain of {levels} directories, each with a file, walked by each of kubevol's walks");
    println!("root: {}", tmp.describe());
    let top = tmp.path().join("volume");
    let make = |top: &Path| -> anyhow::Result<f64> {
        std::fs::create_dir(top)?;
        let t = Instant::now();
        chain(top, levels)?;
        Ok(t.elapsed().as_secs_f64())
    };
    let made = make(&top)?;
    println!("made in {made:.1} s");
    println!();
    println!("{:<48} {:>10} {:>10}", "", "seconds", "CPU s");
    let timed = |name: &str, f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<f64> {
        let (t, cpu) = (Instant::now(), cpu_seconds());
        f()?;
        let (s, c) = (t.elapsed().as_secs_f64(), cpu_seconds() - cpu);
        println!("{name:<48} {s:>10.2} {c:>10.2}");
        Ok(s)
    };
    let rss_before = status_mib("VmRSS:");
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    timed("usage walk (/stats/summary, describe)", &mut || {
        let u = kubevol_mount::usage::walk_usage(&Dir::open(&top)?)?;
        anyhow::ensure!(
            u.inodes == 1 + 2 * levels as u64,
            "counted {} inodes",
            u.inodes
        );
        Ok(())
    })?;
    timed("fsGroup walk (every entry changed)", &mut || {
        Dir::open(&top)?.apply_fs_group(4321, true, kubevol_mount::safe::FsGroupPolicy::Always)?;
        Ok(())
    })?;
    let removal = timed("teardown: one-filesystem check and removal", &mut || {
        Dir::open(tmp.path())?.remove_dir_all_one_fs("volume")?;
        anyhow::ensure!(!top.exists(), "the tree is gone");
        Ok(())
    })?;
    let peak = peak_rss_mib();
    make(&top)?;
    let rm = timed("rm -rf (GNU coreutils), the floor", &mut || {
        let st = std::process::Command::new("rm")
            .arg("-rf")
            .arg(&top)
            .status()?;
        anyhow::ensure!(st.success(), "rm -rf failed");
        Ok(())
    })?;
    println!();
    println!(
        "  teardown / rm -rf                            {:.2}",
        removal / rm
    );
    println!(
        "  peak resident memory while walking           {peak:.1} MiB ({rss_before:.1} MiB before)"
    );
    tmp.release()?;
    Ok(ExitCode::SUCCESS)
}
