//! Memory given back after a storm of pods has gone: once many of the desired pods are gone
//! and the node has been quiet for a moment, the allocator is told to return what it holds
//! free (glibc keeps freed pages in its arenas: 1,000 pods of content volumes churned for a
//! minute left 97 MiB resident for 9 MiB in use; 36 MiB after the trim). Woken by the world's
//! changes only: an idle node does nothing here.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::world::World;

/// How many desired pods must have gone since the last trim (or the peak since) for a trim.
const GONE_FOR_A_TRIM: usize = 100;

/// How long the world must stay unchanged before the trim: a storm of teardowns is over.
const QUIET: Duration = Duration::from_secs(2);

/// Trims the allocator's free memory after a storm of pods went, until `stop`.
pub(crate) async fn trim_after_storms(world: Arc<World>, mut stop: watch::Receiver<bool>) {
    let mut changes = world.subscribe();
    let mut peak = 0usize;
    loop {
        changes.borrow_and_update();
        let pods = world.dsw().pod_count();
        peak = peak.max(pods);
        if peak >= pods + GONE_FOR_A_TRIM {
            tokio::select! {
                quiet = tokio::time::timeout(QUIET, changes.changed()) => match quiet {
                    Err(_) => {
                        let released = tokio::task::spawn_blocking(kubevol_mount::alloc::release_free_memory).await;
                        tracing::debug!(pods, peak, ?released, "{} pods gone: the allocator's free memory given back", peak - pods);
                        peak = pods;
                    }
                    Ok(Err(_)) => return,
                    Ok(Ok(())) => {}
                },
                _ = stop.changed() => return,
            }
        } else {
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { return },
                _ = stop.changed() => return,
            }
        }
    }
}
