//! Names that identify pods and volumes, with the kubelet's spelling.
//!
//! A unique volume name is the key of both states of world. For volumes that belong to one pod
//! (emptyDir, hostPath, configMap, ...) the kubelet spells it `<plugin>/<podUID>-<volume>`;
//! shared volumes (CSI, local) use `<plugin>/<volume id>`.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// The UID of a pod: the directory name under `<root>/pods/`. Shared, not copied: the
/// states, the executor, the record and the events each hold it for every volume, and a copy is
/// a reference count, not an allocation.
#[derive(Clone, Debug, PartialOrd, Ord)]
pub struct PodUid(pub Arc<str>);

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

/// A volume's key in the desired and actual states of world. Shared, as [`PodUid`] is.
#[derive(Clone, Debug, PartialOrd, Ord)]
pub struct UniqueVolumeName(pub Arc<str>);

impl UniqueVolumeName {
    /// The kubelet's name for a volume that belongs to exactly one pod:
    /// `kubernetes.io/empty-dir/<podUID>-<volume>`.
    pub fn for_pod_volume(plugin: &str, pod: &PodUid, volume: &str) -> Self {
        // One allocation of the exact length (every pod volume's name is made here).
        UniqueVolumeName::from([plugin, "/", pod.as_str(), "-", volume].concat().as_str())
    }

    /// The kubelet's name for a volume shared between pods: `<plugin>/<volume id>`.
    pub fn for_shared_volume(plugin: &str, volume_id: &str) -> Self {
        UniqueVolumeName::from(format!("{plugin}/{volume_id}"))
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

/// Equal when they share the one string, else when their strings are equal; hashed as their
/// string. A key is nearly always compared with a copy of itself (the states, the executor and
/// the record each hold copies of one name), which is then one pointer comparison instead of a
/// comparison of a hundred bytes.
macro_rules! equal_when_shared {
    ($t:ident) => {
        impl PartialEq for $t {
            fn eq(&self, other: &Self) -> bool {
                Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
            }
        }

        impl Eq for $t {}

        impl std::hash::Hash for $t {
            fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
                self.0.hash(state)
            }
        }
    };
}

equal_when_shared!(PodUid);
equal_when_shared!(UniqueVolumeName);
equal_when_shared!(SharedStr);

/// Both names are written and read as plain strings.
macro_rules! shared_name {
    ($t:ident) => {
        impl From<&str> for $t {
            fn from(s: &str) -> Self {
                $t(s.into())
            }
        }

        impl From<String> for $t {
            fn from(s: String) -> Self {
                $t(s.into())
            }
        }

        impl Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                String::deserialize(d).map($t::from)
            }
        }
    };
}

shared_name!(PodUid);
shared_name!(UniqueVolumeName);

/// A string held by many (a pod's namespace and name, kept with each of its volumes in both
/// states): a copy is a reference count. Reads as a `&str`.
#[derive(Clone, Default, PartialOrd, Ord)]
pub struct SharedStr(Arc<str>);

impl SharedStr {
    /// The string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The one shared copy of a name known when kubevol is built (a plugin's name): the first
    /// call allocates it, every later one is a reference count.
    pub fn interned(name: &'static str) -> SharedStr {
        static NAMES: std::sync::Mutex<Vec<(&'static str, SharedStr)>> =
            std::sync::Mutex::new(Vec::new());
        let mut names = NAMES.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, s)) = names.iter().find(|(n, _)| *n == name) {
            return s.clone();
        }
        let s = SharedStr::from(name);
        names.push((name, s.clone()));
        s
    }
}

impl std::ops::Deref for SharedStr {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for SharedStr {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl AsRef<std::path::Path> for SharedStr {
    fn as_ref(&self) -> &std::path::Path {
        self.0.as_ref().as_ref()
    }
}

impl std::borrow::Borrow<str> for SharedStr {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl PartialEq<str> for SharedStr {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for SharedStr {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl fmt::Debug for SharedStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for SharedStr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

shared_name!(SharedStr);

/// Who a pod is: enough to name it in a message and find its directory.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PodRef {
    /// The pod's namespace.
    pub namespace: SharedStr,
    /// The pod's name.
    pub name: SharedStr,
    /// The pod's UID.
    pub uid: PodUid,
}

impl fmt::Display for PodRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The built-in plugins' names and their directories, spelled out: every volume's path is made
/// from one, and these need no new string each time.
const BUILT_IN_PLUGIN_DIRS: [(&str, &str); 9] = [
    ("kubernetes.io/empty-dir", "kubernetes.io~empty-dir"),
    ("kubernetes.io/host-path", "kubernetes.io~host-path"),
    ("kubernetes.io/configmap", "kubernetes.io~configmap"),
    ("kubernetes.io/secret", "kubernetes.io~secret"),
    ("kubernetes.io/downward-api", "kubernetes.io~downward-api"),
    ("kubernetes.io/projected", "kubernetes.io~projected"),
    ("kubernetes.io/local-volume", "kubernetes.io~local-volume"),
    ("kubernetes.io/csi", "kubernetes.io~csi"),
    ("kubernetes.io/image", "kubernetes.io~image"),
];

/// The directory name a plugin's volumes live under in a pod directory: the kubelet escapes the
/// `/` of the plugin name as `~` (`kubernetes.io/empty-dir` → `kubernetes.io~empty-dir`).
pub fn escape_plugin_name(plugin: &str) -> std::borrow::Cow<'static, str> {
    match BUILT_IN_PLUGIN_DIRS
        .iter()
        .find(|(name, _)| *name == plugin)
    {
        Some((_, escaped)) => std::borrow::Cow::Borrowed(escaped),
        None => std::borrow::Cow::Owned(plugin.replace('/', "~")),
    }
}

/// The claim a pod's volume uses: the one `persistentVolumeClaim.claimName` names, or for a
/// generic ephemeral volume (`ephemeral.volumeClaimTemplate`) the one the ephemeral-volume
/// controller makes for it, `<pod name>-<volume name>`.
pub fn claim_name<'a>(
    pod_name: &str,
    volume: &'a k8s_openapi::api::core::v1::Volume,
) -> Option<std::borrow::Cow<'a, str>> {
    if let Some(c) = &volume.persistent_volume_claim {
        return Some(std::borrow::Cow::Borrowed(c.claim_name.as_str()));
    }
    volume
        .ephemeral
        .as_ref()
        .map(|_| std::borrow::Cow::Owned(format!("{pod_name}-{}", volume.name)))
}

/// One component of a path under the root directory or the local-path directory, made from
/// a name that came from a manifest, the API server or a volume: the one way such a name
/// becomes part of a path. It is never empty, `.` or `..`, never holds `/` or NUL, and is at
/// most 255 bytes (the longest name a Linux filesystem takes), so that joined to a directory it
/// names an entry of that directory and nothing else.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PathName(String);

/// Why a name cannot be a path component.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} {value:?} cannot name a directory: {why}")]
pub struct PathNameError {
    /// What the name is (`"the claim's UID"`).
    pub what: &'static str,
    /// The name, cut to 80 characters.
    pub value: String,
    /// What is wrong with it.
    pub why: &'static str,
}

impl PathName {
    /// The longest name a component may have, in bytes.
    pub const MAX_LEN: usize = 255;

    /// Takes `name` (`what` it is, for the message) as one path component, or says why it
    /// cannot be one.
    pub fn new(what: &'static str, name: &str) -> Result<PathName, PathNameError> {
        let why = if name.is_empty() {
            Some("it is empty")
        } else if name == "." || name == ".." {
            Some("'.' and '..' name no directory of their own")
        } else if name.contains('/') {
            Some("it holds a '/'")
        } else if name.contains('\0') {
            Some("it holds a NUL byte")
        } else if name.len() > Self::MAX_LEN {
            Some("it is longer than 255 bytes")
        } else {
            None
        };
        match why {
            None => Ok(PathName(name.to_string())),
            Some(why) => Err(PathNameError {
                what,
                value: name.chars().take(80).collect(),
                why,
            }),
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PathName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<std::path::Path> for PathName {
    fn as_ref(&self) -> &std::path::Path {
        self.0.as_ref()
    }
}

impl AsRef<std::ffi::OsStr> for PathName {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What every name type reads as, in messages and as a string.
    #[test]
    fn names_read_as_their_strings() {
        let uid = PodUid::from("0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70");
        assert_eq!(uid.to_string(), "0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70");
        let volume = UniqueVolumeName::for_pod_volume("kubernetes.io/empty-dir", &uid, "cache");
        assert_eq!(
            volume.to_string(),
            "kubernetes.io/empty-dir/0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70-cache"
        );
        let s = SharedStr::from("team-a");
        assert_eq!(
            (s.as_str(), &*s, s.as_ref()),
            ("team-a", "team-a", "team-a")
        );
        assert_eq!(std::borrow::Borrow::<str>::borrow(&s), "team-a");
        assert!(s == *"team-a" && s != *"team-b");
        assert!(s == "team-a" && s != "team-b");
        assert_eq!(format!("{s} {s:?}"), "team-a \"team-a\"");
        let pod = PodRef {
            namespace: "team-a".into(),
            name: "web".into(),
            uid,
        };
        assert_eq!(pod.to_string(), "team-a/web");
        let leaf = PathName::new("a volume's directory", "pvc-1").unwrap();
        assert_eq!(leaf.to_string(), "pvc-1");
    }

    /// A name known when kubevol is built is one shared copy: equal names, the same pointer;
    /// another name, another copy.
    #[test]
    fn interned_names_are_one_copy_each() {
        let a = SharedStr::interned("kubernetes.io/csi");
        let again = SharedStr::interned("kubernetes.io/csi");
        let other = SharedStr::interned("kubernetes.io/secret");
        assert_eq!(a.as_str(), "kubernetes.io/csi");
        assert!(Arc::ptr_eq(&a.0, &again.0));
        assert_eq!(other.as_str(), "kubernetes.io/secret");
        assert!(!Arc::ptr_eq(&a.0, &other.0));
    }

    /// The claim a volume uses: the one it names, or for a generic ephemeral volume
    /// `<pod>-<volume>`; none for other volumes.
    #[test]
    fn a_volumes_claim_is_named_or_made_from_the_pod_and_volume() {
        let volume = |v: serde_json::Value| -> k8s_openapi::api::core::v1::Volume {
            serde_json::from_value(v).unwrap()
        };
        let named = volume(
            serde_json::json!({"name": "data", "persistentVolumeClaim": {"claimName": "db"}}),
        );
        assert_eq!(claim_name("web", &named).as_deref(), Some("db"));
        let ephemeral = volume(
            serde_json::json!({"name": "scratch", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}}),
        );
        assert_eq!(
            claim_name("web", &ephemeral).as_deref(),
            Some("web-scratch")
        );
        let other = volume(serde_json::json!({"name": "cache", "emptyDir": {}}));
        assert_eq!(claim_name("web", &other), None);
    }

    #[test]
    fn names_are_equal_by_their_strings_whether_shared_or_not() {
        use std::hash::BuildHasher;
        let hasher = std::collections::hash_map::RandomState::new();
        let a = UniqueVolumeName::from("kubernetes.io/empty-dir/uid-v0");
        let shared = a.clone();
        let copied = UniqueVolumeName::from(a.as_str());
        let other = UniqueVolumeName::from("kubernetes.io/empty-dir/uid-v1");
        assert!(Arc::ptr_eq(&a.0, &shared.0) && !Arc::ptr_eq(&a.0, &copied.0));
        assert_eq!(a, shared);
        assert_eq!(a, copied);
        assert_ne!(a, other);
        assert_eq!(hasher.hash_one(&a), hasher.hash_one(&copied));
        assert_eq!(hasher.hash_one(&a), hasher.hash_one(a.as_str()));
        let (p, q) = (PodUid::from("u"), PodUid::from("u"));
        assert_eq!(p, q);
        assert_ne!(p, PodUid::from("w"));
        let (s, t) = (SharedStr::from("n"), SharedStr::from("n"));
        assert_eq!(s, t);
        assert_eq!(hasher.hash_one(&s), hasher.hash_one("n"));
        assert_ne!(s, SharedStr::from("m"));
    }

    /// Every kind of hostile name: a separator, a backstep, a NUL, one too long.
    #[test]
    fn a_path_name_is_one_component_and_nothing_else() {
        let long = "a".repeat(300);
        let rows: [(&str, &str, Option<&str>); 10] = [
            ("plain", "pvc-0b3f4c2e", None),
            ("dots inside", "a..b", None),
            ("255 bytes", &long[..255], None),
            ("empty", "", Some("empty")),
            ("dot", ".", Some("'.'")),
            ("backstep", "..", Some("'..'")),
            ("separator", "a/b", Some("'/'")),
            ("escape", "u1_default_c/../pvc-u1", Some("'/'")),
            ("nul", "a\0b", Some("NUL")),
            ("300 bytes", &long, Some("255 bytes")),
        ];
        for (row, name, refused) in rows {
            match (PathName::new("the name", name), refused) {
                (Ok(p), None) => assert_eq!(p.as_str(), name, "{row}"),
                (Err(e), Some(why)) => {
                    assert!(e.to_string().contains(why), "{row}: {e}");
                    assert!(e.value.chars().count() <= 80, "{row}");
                }
                (r, _) => panic!("{row}: {r:?}"),
            }
        }
    }

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
        for (plugin, dir) in BUILT_IN_PLUGIN_DIRS {
            assert_eq!(dir, plugin.replace('/', "~"), "{plugin}");
            assert!(matches!(
                escape_plugin_name(plugin),
                std::borrow::Cow::Borrowed(d) if d == dir
            ));
        }
        assert_eq!(
            escape_plugin_name("example.com/some/plugin"),
            "example.com~some~plugin"
        );
    }
}
