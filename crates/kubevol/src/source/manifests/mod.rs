//! The manifest-directory source: every `*.yaml`, `*.yml` and `*.json` file of a directory,
//! multi-document, parsed into Kubernetes objects, and watched with inotify so that adding,
//! changing or removing a file updates the store within one event.
//!
//! A file with an error (it does not parse, or a document is not a valid object) is reported with
//! its path, document, line and column and is not applied: the objects it delivered before stay
//! in place, so a half-saved edit never unmounts a running pod. Other files are unaffected.

use std::path::Path;

mod locate;
mod parse;
mod read;
mod shape;
#[cfg(feature = "manifests")]
mod watch;
#[cfg(feature = "manifests")]
mod way;

pub use parse::{humanize, parse_manifest};
pub use read::{read_file, Occasion, ReadLimits, DEFAULT_MAX_FILE_SIZE};
#[cfg(feature = "manifests")]
pub use watch::ManifestSource;

/// Whether a file name is a manifest kubevol reads.
pub fn is_manifest_file(path: &Path) -> bool {
    let hidden = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_none_or(|n| n.starts_with('.'));
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    !hidden && matches!(ext, "yaml" | "yml" | "json")
}
