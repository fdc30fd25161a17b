//! Names that identify pods and volumes, with the kubelet's spelling.
//!
//! A unique volume name is the key of both states of world. For volumes that belong to one pod
//! (emptyDir, hostPath, configMap, ...) the kubelet spells it `<plugin>/<podUID>-<volume>`;
//! shared volumes (CSI, local) use `<plugin>/<volume id>`.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The UID of a pod: the directory name under `<root>/pods/`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PodUid(pub String);

impl PodUid {
    /// The UID as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PodUid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A volume's key in the desired and actual states of world.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct UniqueVolumeName(pub String);

impl UniqueVolumeName {
    /// The kubelet's name for a volume that belongs to exactly one pod:
    /// `kubernetes.io/empty-dir/<podUID>-<volume>`.
    pub fn for_pod_volume(plugin: &str, pod: &PodUid, volume: &str) -> Self {
        UniqueVolumeName(format!("{plugin}/{pod}-{volume}"))
    }

    /// The kubelet's name for a volume shared between pods: `<plugin>/<volume id>`.
    pub fn for_shared_volume(plugin: &str, volume_id: &str) -> Self {
        UniqueVolumeName(format!("{plugin}/{volume_id}"))
    }

    /// The name as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for UniqueVolumeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Who a pod is: enough to name it in a message and find its directory.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PodRef {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// The pod's UID.
    pub uid: PodUid,
}

impl fmt::Display for PodRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The directory name a plugin's volumes live under in a pod directory: the kubelet escapes the
/// `/` of the plugin name as `~` (`kubernetes.io/empty-dir` → `kubernetes.io~empty-dir`).
pub fn escape_plugin_name(plugin: &str) -> String {
    plugin.replace('/', "~")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_volume_name_matches_kubelet_spelling() {
        let uid = PodUid("0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70".into());
        assert_eq!(
            UniqueVolumeName::for_pod_volume("kubernetes.io/empty-dir", &uid, "cache").as_str(),
            "kubernetes.io/empty-dir/0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70-cache"
        );
    }

    #[test]
    fn plugin_directory_escapes_slash() {
        assert_eq!(
            escape_plugin_name("kubernetes.io/host-path"),
            "kubernetes.io~host-path"
        );
    }
}
