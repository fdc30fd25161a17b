//! Pod sources: where pods and the objects they reference come from.
//!
//! A source writes into the [`crate::store::ObjectStore`] and marks itself synced once it has
//! delivered a complete first listing. Sources never touch the states of world.

pub mod manifests;

pub use manifests::{parse_manifest, ManifestSource};
