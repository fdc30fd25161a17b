//! `kubevol bench --volume-stats FILES`: what measuring one emptyDir of FILES files and
//! directories costs, as every volume-stats period measures every volume: the kubelet's own
//! MetricsDu (its `fs.DiskUsage` walk and statfs, built from the pinned `k8s.io/kubernetes`
//! module), kubevol's walk, kubevol's project quota where the benchmark's filesystem accounts
//! project quotas, and the raw floor (a single-threaded stat of every entry), on the same tree
//! in the same run. The figures of the three walks agree or the benchmark fails.

use std::ffi::OsStr;
use std::os::fd::AsFd;

use super::fsgroup::{figure, fill_tree, harness, open_dir, raw_walk, run_harness};
use super::*;
use kubevol_mount::safe::Dir;
use kubevol_mount::usage::{self, FIRST_PROJECT};

/// How many times the project quota is read (one read takes microseconds).
const QUOTA_READS: u32 = 1000;

/// Runs the volume-stats benchmark on `files` entries.
pub fn run(args: &BenchArgs, files: usize) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        files > 0,
        "--volume-stats: give the number of files (e.g. 100000)"
    );
    let harness = harness();
    let (tmp, _) = BenchRoot::new(args)?;
    let vol = tmp.path().join("volume");
    // The volume gets its project before anything is in it, as a set-up gives it.
    std::fs::create_dir(&vol)?;
    let project = {
        let dir = Dir::open(&vol)?;
        match usage::project_quotas(&dir) {
            true => usage::give_project(&dir, FIRST_PROJECT)?.then_some(FIRST_PROJECT),
            false => None,
        }
    };
    let t = Instant::now();
    fill_tree(&vol, files)?;
    println!("kubevol bench --volume-stats {files}: one emptyDir of {files} files and directories");
    println!("root: {}", tmp.describe());
    println!("tree made in {:.1} s", t.elapsed().as_secs_f64());

    let floor = {
        let fd = open_dir(rustix::fs::CWD, vol.as_os_str())?;
        let t = Instant::now();
        raw_walk(fd.as_fd(), 0, (0, 0), true).context("the raw walk")?;
        t.elapsed().as_secs_f64()
    };
    let dir = Dir::open(&vol)?;
    let t = Instant::now();
    let walked = usage::walk_usage(&dir)?;
    let kubevol_walk = t.elapsed().as_secs_f64();
    println!();
    println!(
        "{:<44} {:>12} {:>14} {:>10}",
        "", "seconds", "bytes", "inodes"
    );
    println!(
        "{:<44} {floor:>12.4}",
        "raw single-threaded stat of every entry"
    );
    println!(
        "{:<44} {kubevol_walk:>12.4} {:>14} {:>10}",
        "kubevol walk", walked.bytes, walked.inodes
    );
    println!(
        "  kubevol walk / floor (time)                {:.2}",
        kubevol_walk / floor
    );
    match &harness {
        Ok(h) => {
            let f = run_harness(h, &[OsStr::new("du"), vol.as_os_str()])?;
            let (seconds, bytes, inodes) = (
                figure(&f, "seconds")?,
                figure(&f, "bytes")?,
                figure(&f, "inodes")?,
            );
            println!(
                "{:<44} {seconds:>12.4} {bytes:>14} {inodes:>10}",
                "kubelet MetricsDu (fs.DiskUsage + statfs)"
            );
            anyhow::ensure!(
                (bytes as u64, inodes as u64) == (walked.bytes, walked.inodes),
                "kubevol's walk and the kubelet's disagree"
            );
            println!(
                "  kubevol walk is faster than the kubelet's {:.2}x",
                seconds / kubevol_walk
            );
        }
        Err(e) => println!("the kubelet's MetricsDu is not measured: {e:#}"),
    }
    match project {
        Some(id) => {
            let t = Instant::now();
            let mut quota = usage::Usage::default();
            for _ in 0..QUOTA_READS {
                quota = usage::project_usage(&dir, id)?;
            }
            let each = t.elapsed().as_secs_f64() / f64::from(QUOTA_READS);
            println!(
                "{:<44} {each:>12.7} {:>14} {:>10}",
                "kubevol project quota (one quotactl)", quota.bytes, quota.inodes
            );
            println!("  the walk costs {:.0}x the quota", kubevol_walk / each);
        }
        None => println!(
            "project quotas: not accounted on the benchmark's filesystem ({}; XFS with prjquota, or ext4 with the project feature and prjquota, in a kernel with quota support): every volume is walked",
            tmp.describe()
        ),
    }
    drop(dir);
    tmp.release()?;
    Ok(ExitCode::SUCCESS)
}
