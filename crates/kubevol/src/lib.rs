//! kubevol: the Kubernetes node volume manager as a library.
//!
//! A node agent creates a [`VolumeManager`], feeds it pods (with [`VolumeManager::add_pod`], or a
//! [`source::ManifestSource`] over a directory of manifests), runs it, and calls
//! [`VolumeManager::wait_for_attach_and_mount`] before starting a pod's containers and
//! [`VolumeManager::wait_for_unmount`] after killing them:
//!
//! ```no_run
//! # async fn demo(pod: k8s_openapi::api::core::v1::Pod) -> anyhow::Result<()> {
//! use std::sync::Arc;
//! use kubevol::{Config, VolumeManager};
//!
//! let manager = VolumeManager::new(Config::new("/var/lib/kubevol", "node-1"), Arc::new(kubevol_mount::LinuxMounter))?;
//! let running = tokio::spawn({ let m = manager.clone(); async move { m.run().await } });
//! let uid = manager.add_pod(pod.clone());
//! manager.wait_for_attach_and_mount(&pod).await?;
//! for (name, v) in manager.mounted_volumes_for_pod(&uid) {
//!     println!("{name} -> {} (read-only: {})", v.path.display(), v.read_only);
//! }
//! manager.remove_pod(&pod);
//! manager.wait_for_unmount(&pod).await?;
//! manager.shutdown();
//! running.await?;
//! # Ok(()) }
//! ```
//!
//! The crate's folders follow the data flow (see ARCHITECTURE.md): [`source`]s fill the
//! [`store`]; the [`populator`] turns its pods into the desired state of the world; the
//! reconciler compares it with the actual state and starts operations, which run [`plugins`]
//! through the mount layer (`kubevol-mount`) and [`csi`] drivers, writing a durable [`record`]
//! before every side effect; [`reconstruct`]ion rebuilds the actual state at start; [`status`],
//! [`events`], [`metrics`] and [`http`] are what an operator sees.

pub mod certificates;
pub mod containers;
pub mod csi;
mod dir_watch;
pub mod error;
mod inspect;
mod manager;
mod memory;
pub mod node;
mod operations;
pub mod plugins;
pub mod populator;
mod reconciler;
pub mod reconstruct;
pub mod record;
mod report;
pub mod source;
pub mod storage;
pub mod store;
mod sync;
pub mod tokens;
mod waiters;
mod world;

pub use manager::{Config, Selinux, VolumeManager};

/// A boxed future, so that plugins, pod sources and token issuers can be trait objects.
pub type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'static>>;
#[cfg(feature = "http")]
pub use inspect::http;
pub use inspect::{describe, status};
pub use report::{events, metrics};
pub use store::{pod_uid, PodIdentity};
pub use waiters::WaitError;
pub use world::MountedVolume;

/// The user guide's library page, whose example is compiled as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/library.md")]
pub struct LibraryGuide;
