//! The sweep of orphaned pod directories: the directory of a pod that is gone and has nothing
//! left on the node is removed with rmdir only, never crossing a mount point; whatever is left
//! is reported, not deleted.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use kubevol_core::PodUid;
use tokio::sync::watch;
use tracing::warn;

use super::{dirs, name_of, Findings, Leftover};
use crate::events::EventRecorder;
use crate::metrics::Metrics;
use crate::plugins::PluginHost;
use crate::world::World;

/// What the sweep works with.
pub(crate) struct Sweep {
    pub(crate) world: Arc<World>,
    pub(crate) host: Arc<PluginHost>,
    pub(crate) events: Arc<EventRecorder>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) findings: Arc<Findings>,
    pub(crate) period: Duration,
}

/// One sweep: removes the directories of gone pods that have nothing left on the node.
/// Returns how many were removed; leftovers are kept in the findings.
pub(crate) async fn sweep_orphans(s: &Sweep) -> usize {
    let foreign: BTreeSet<String> = crate::sync::lock(&s.findings.reconstruction)
        .foreign_pods
        .iter()
        .map(|f| f.uid.clone())
        .collect();
    let candidates: Vec<PodUid> = {
        let dsw = s.world.dsw();
        let asw = s.world.asw();
        dirs(&s.host.root.join("pods"))
            .iter()
            .map(|p| PodUid::from(name_of(p)))
            .filter(|u| {
                dsw.pod(u).is_none()
                    && asw.pod_volumes(u).next().is_none()
                    && !foreign.contains(u.as_str())
            })
            .collect()
    };
    let host = s.host.clone();
    let results = tokio::task::spawn_blocking(move || {
        host.remove_pod_dirs(candidates.into_iter().map(|uid| (uid, None)))
    })
    .await
    .unwrap_or_default();
    let mut cleaned = 0;
    let mut leftovers = BTreeMap::new();
    for (uid, r) in results {
        // A pod that came back while the sweep ran is not an orphan.
        if s.world.dsw().pod(&uid).is_some() {
            continue;
        }
        match r {
            Ok(()) => {
                cleaned += 1;
                s.events.forget(&uid);
                s.world.forget_pod_signal(&uid);
            }
            // Removed meanwhile by the teardown of its last volume.
            Err(e) if e.is_not_found() => cleaned += 1,
            Err(e) => {
                let path = s.host.root.join("pods").join(uid.as_str());
                leftovers.insert(
                    uid.clone(),
                    Leftover {
                        uid: uid.to_string(),
                        path: path.display().to_string(),
                        reason: format!(
                            "orphaned pod directory kept: {e}. kubevol removes directories only with rmdir and never through a mount; remove what is left by hand once it is no longer needed"
                        ),
                    },
                );
            }
        }
    }
    let errors = leftovers.len();
    let changed = {
        let mut l = crate::sync::lock(&s.findings.leftovers);
        let changed = *l != leftovers;
        *l = leftovers;
        changed
    };
    if changed {
        for l in crate::sync::lock(&s.findings.leftovers).values() {
            warn!(pod = %l.uid, "{}", l.reason);
        }
        s.world.announce();
    }
    s.metrics.set_orphan_sweep(cleaned, errors);
    cleaned
}

/// Sweeps orphaned pod directories once every pod source has listed its pods and the first
/// full reconcile is done, then after changes of the world (a pod gone, a volume torn down), at
/// most once a period, until `stop` says so. An idle node is not swept: nothing can have become
/// an orphan. While directories are kept as leftovers, they are looked at again every period
/// (whoever clears them by hand sees them go).
pub(crate) async fn sweep_loop(s: Sweep, mut stop: watch::Receiver<bool>) {
    let mut changes = s.world.subscribe();
    while !s.world.states_synced() {
        tokio::select! {
            r = changes.changed() => if r.is_err() { return },
            _ = stop.changed() => return,
        }
    }
    loop {
        // Changes from here on call for another sweep.
        changes.borrow_and_update();
        let began = tokio::time::Instant::now();
        sweep_orphans(&s).await;
        if crate::sync::lock(&s.findings.leftovers).is_empty() {
            tokio::select! {
                r = changes.changed() => if r.is_err() { return },
                _ = stop.changed() => return,
            }
        }
        tokio::select! {
            _ = tokio::time::sleep_until(began + s.period) => {}
            _ = stop.changed() => return,
        }
    }
}
