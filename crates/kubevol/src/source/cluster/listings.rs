//! The count of a cluster source's complete listings.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// How many complete listings a `ClusterSource`'s watches have made: one each at the start,
/// and one more each time a watch cannot resume from its last resource version (`410 Gone`
/// after the server's history was compacted) and lists again.
#[derive(Clone, Debug, Default)]
pub struct Listings(Arc<ListingCounts>);

#[derive(Debug, Default)]
struct ListingCounts {
    pods: AtomicU64,
    objects: AtomicU64,
    /// The server refused a streaming list (a watch with `sendInitialEvents`): it has no
    /// WatchList feature, and objects are listed, then watched.
    no_streaming: AtomicBool,
}

impl Listings {
    /// Listings of the node's pods.
    pub fn pods(&self) -> u64 {
        self.0.pods.load(Ordering::Relaxed)
    }

    /// Listings of the objects watched by name (ConfigMaps, Secrets, the Node), together.
    pub fn objects(&self) -> u64 {
        self.0.objects.load(Ordering::Relaxed)
    }

    pub(super) fn listed_pods(&self) {
        self.0.pods.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn listed_object(&self) {
        self.0.objects.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether an object watched by name is read with one streaming list (a watch that sends
    /// the object first), rather than a list and then a watch.
    pub fn streams(&self) -> bool {
        !self.0.no_streaming.load(Ordering::Relaxed)
    }

    pub(super) fn cannot_stream(&self) {
        self.0.no_streaming.store(true, Ordering::Relaxed);
    }
}
