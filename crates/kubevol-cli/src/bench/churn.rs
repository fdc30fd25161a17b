//! `kubevol bench --churn SECONDS`: waves of N pods come and go for SECONDS (each wave added
//! at once, waited for, removed at once, waited for), then every pod is gone. It prints the
//! resident memory of the idle manager before the first wave, with the first wave mounted, at
//! its peak, and once every pod is gone after the churn: what a node that has run pods for
//! hours holds on to for pods it no longer has.

use super::*;

/// The content benchmark's pod, with a downwardAPI volume besides: four content volumes.
fn content_pod(i: usize) -> Pod {
    let mut p = super::content::pod(i);
    let spec = p.spec.as_mut().expect("a spec");
    spec.containers[0]
        .volume_mounts
        .get_or_insert_with(Vec::new)
        .push(
            serde_json::from_value(serde_json::json!({"name": "info", "mountPath": "/info"}))
                .expect("a mount"),
        );
    spec.volumes.get_or_insert_with(Vec::new).push(
        serde_json::from_value(
            serde_json::json!({"name": "info", "downwardAPI": {"items": [
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}}),
        )
        .expect("a volume"),
    );
    p
}

/// Runs the churn benchmark for `seconds`.
pub fn run(args: &BenchArgs, seconds: u64) -> anyhow::Result<ExitCode> {
    let n = args.pods();
    let (tmp, _) = BenchRoot::new(args)?;
    let volumes = if args.content { 4 } else { args.volumes };
    match args.content {
        true => println!(
            "kubevol bench --churn {seconds} --content: waves of {n} pods x 4 content volumes (configMap, secret, projected, downwardAPI), added and removed for {seconds} s"
        ),
        false => println!(
            "kubevol bench --churn {seconds}: waves of {n} pods x {volumes} Memory emptyDir volumes, added and removed for {seconds} s"
        ),
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let root = tmp.path().join("root");
    let figures = runtime.block_on(async {
        let (manager, running) = start_manager(&root, args, |_| {})?;
        if args.content {
            manager.library().upsert_objects(super::content::objects(0));
        }
        let input = |wave: usize| -> Vec<Pod> {
            (0..n)
                .map(|i| {
                    let mut p = match args.content {
                        true => content_pod(i),
                        false => pod(i, args.volumes),
                    };
                    // Every wave's pods are new pods (another UID), as a node sees them.
                    p.metadata.name = Some(format!("bench-{wave}-{i}"));
                    p
                })
                .collect()
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        let empty = status_mib("VmRSS:");
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        let start = tokio::time::Instant::now();
        let (mut waves, mut loaded) = (0, 0.0);
        while waves == 0 || start.elapsed() < Duration::from_secs(seconds) {
            let wave = input(waves);
            let pods = handles(&wave);
            add_and_wait(&manager, wave, &pods).await?;
            if waves == 0 {
                loaded = status_mib("VmRSS:");
            }
            manager.remove_pods(&pods);
            manager.wait_for_all_pods_unmount(&pods).await?;
            waves += 1;
        }
        let churned = start.elapsed();
        // What is left once the node is quiet again: threads of the blocking pool idle for
        // ten seconds end.
        tokio::time::sleep(Duration::from_secs(12)).await;
        let after = status_mib("VmRSS:");
        let peak = peak_rss_mib();
        let left = manager.status(false).pods.len();
        manager.shutdown();
        let _ = running.await;
        anyhow::Ok((empty, loaded, peak, after, waves, churned, left))
    });
    let (empty, loaded, peak, after, waves, churned, left) = figures?;
    println!();
    println!(
        "{waves} waves, {} pods and {} volumes set up and torn down in {:.1} s; {left} pods left",
        waves * n,
        waves * n * volumes,
        churned.as_secs_f64()
    );
    println!("resident memory (MiB):");
    println!("  idle, before any pod      {empty:8.1}");
    println!("  the first wave mounted    {loaded:8.1}");
    println!("  peak                      {peak:8.1}");
    println!(
        "  every pod gone after it   {after:8.1}   ({:.2} times idle before, {:.2} times the first wave)",
        after / empty,
        after / loaded
    );
    tmp.release()?;
    Ok(ExitCode::SUCCESS)
}
