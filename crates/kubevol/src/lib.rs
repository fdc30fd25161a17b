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
//! The crate follows the kubelet's split: sources fill the [`store`], the [`populator`] turns
//! pods into the desired state of world, the [`reconciler`](crate::VolumeManager::run) compares
//! it with the actual state and starts operations through the [`executor`], and
//! [`plugins`] do the work through the mount layer (`kubevol-mount`).

pub mod claims;
pub mod csi;
pub mod error;
pub mod events;
pub mod executor;
pub mod http;
mod manager;
pub mod metrics;
pub mod node;
pub mod plugins;
pub mod populator;
mod reconciler;
pub mod reconstruct;
pub mod record;
mod slots;
pub mod source;
pub mod status;
pub mod store;
mod subpath;
mod sync;

pub use manager::{Config, MountedVolume, VolumeManager, WaitError};
pub use store::pod_uid;
