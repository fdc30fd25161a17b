//! Pod sources: where pods and the objects they reference come from.
//!
//! Every source implements [`PodSource`]: it is started with a [`Sink`], the only way to write
//! the [`ObjectStore`](crate::store::ObjectStore), delivers its objects through it, and says
//! once its first listing is complete (nothing is torn down before every source has). The
//! manifest directory ([`ManifestSource`]), the API server ([`ClusterSource`]) and the library
//! API ([`Library`]) are the sources; sources never touch the states of world.

#[cfg(feature = "cluster")]
pub mod cluster;
pub mod extensions;
pub mod library;
pub mod manifests;
pub mod unknown;

#[cfg(feature = "cluster")]
pub use cluster::ClusterSource;
pub use library::Library;
pub use manifests::parse_manifest;
#[cfg(feature = "manifests")]
pub use manifests::ManifestSource;

pub use crate::store::Sink;

pub use crate::BoxFuture;

/// A source of pods and of the objects they reference.
pub trait PodSource: Send + 'static {
    /// The source's name in the sync gate.
    fn name(&self) -> &'static str;

    /// Starts the source: it delivers its first complete listing through `sink`, then calls
    /// [`Sink::synced`], then delivers every change. The returned future runs the source until
    /// it is dropped.
    fn start(self: Box<Self>, sink: Sink) -> BoxFuture<()>;
}
