//! `kubevol bench --versus-kubelet`: the default benchmark (N pods of M Memory emptyDir volumes
//! added at once), then the same workload given to the kubelet's own VolumeManager
//! (`pkg/kubelet/volumemanager` of the pinned `k8s.io/kubernetes`, with its emptyDir plugin and
//! the node's real mounter, built by `tools/k8s/build-harness.sh`), in the same private mount
//! namespace on a fresh tmpfs, and the ratios of the two.

use std::ffi::OsStr;

use super::fsgroup::{figure, run_harness};
use super::*;

/// What the kubelet's VolumeManager did with the workload, in seconds.
struct Kubelet {
    p50: f64,
    p99: f64,
    mounted: f64,
    unmounted: f64,
}

fn kubelet(harness: &Path, root: &Path, pods: usize, volumes: usize) -> anyhow::Result<Kubelet> {
    let (pods, volumes) = (pods.to_string(), volumes.to_string());
    let args: Vec<&OsStr> = vec![
        "volume-manager".as_ref(),
        "--root".as_ref(),
        root.as_os_str(),
        "--pods".as_ref(),
        pods.as_ref(),
        "--volumes".as_ref(),
        volumes.as_ref(),
    ];
    let figures = run_harness(harness, &args)?;
    Ok(Kubelet {
        p50: figure(&figures, "p50")?,
        p99: figure(&figures, "p99")?,
        mounted: figure(&figures, "mounted")?,
        unmounted: figure(&figures, "unmounted")?,
    })
}

/// Runs kubevol's benchmark and the kubelet's on the same workload, and prints both.
pub(super) fn run(args: &BenchArgs, runtime: &tokio::runtime::Runtime) -> anyhow::Result<ExitCode> {
    let harness = super::fsgroup::harness()?;
    let n = args.pods();
    let f = measure(args, n, runtime)?;
    f.print(args);
    let (tmp, _) = BenchRoot::new(args)?;
    let root = tmp.path().join("kubelet");
    std::fs::create_dir(&root)?;
    let k = kubelet(&harness, &root, n, args.volumes)?;
    let left = LinuxMounter
        .mount_table()?
        .into_iter()
        .filter(|m| m.mount_point.starts_with(&root))
        .count();
    anyhow::ensure!(left == 0, "the kubelet's VolumeManager left {left} mounts");
    tmp.release()?;
    let total = n * args.volumes;
    let kv_p50 = percentile(&f.latencies, 0.5);
    let kv_p99 = percentile(&f.latencies, 0.99);
    println!();
    println!(
        "the kubelet's own VolumeManager (k8s.io/kubernetes, emptyDir plugin, mount(8) as on a node), the same {n} pods x {} volumes:",
        args.volumes
    );
    println!("                        kubevol      kubelet    kubelet/kubevol");
    println!(
        "  ready p50          {:9.1} ms {:9.1} ms   {:8.0}x",
        kv_p50 * 1e3,
        k.p50 * 1e3,
        k.p50 / kv_p50
    );
    println!(
        "  ready p99          {:9.1} ms {:9.1} ms   {:8.0}x",
        kv_p99 * 1e3,
        k.p99 * 1e3,
        k.p99 / kv_p99
    );
    let kv_down = total as f64 / f.kv_unmount;
    println!(
        "  all torn down      {:9.1} ms {:9.1} ms   {:8.0}x",
        kv_down * 1e3,
        k.unmounted * 1e3,
        k.unmounted / kv_down
    );
    println!(
        "  (the kubelet's every pod mounted after {:.1} ms)",
        k.mounted * 1e3
    );
    Ok(ExitCode::SUCCESS)
}
