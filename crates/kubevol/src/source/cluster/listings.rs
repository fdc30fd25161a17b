//! The count of a cluster source's complete listings.

use std::sync::atomic::{AtomicU64, Ordering};
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
}
