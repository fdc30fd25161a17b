//! Pure logic of kubevol: volume and pod names, quantities, pod validation, the desired and
//! actual state of world, the reconciler's decisions and per-key backoff.
//!
//! This crate owns no I/O: it never reads a clock, touches a file or makes a syscall. Everything
//! here is a value or a function of values, so the volume manager's rules can be tested without
//! root and without a runtime.

pub mod affinity;
pub mod backoff;
pub mod binding;
pub mod collections;
pub mod migration;
pub mod names;
pub mod projection;
pub mod quantity;
pub mod reconcile;
pub mod selinux;
pub mod snapshot;
pub mod state;
pub mod validation;

pub use names::{PodRef, PodUid, UniqueVolumeName};
