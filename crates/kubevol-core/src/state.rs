//! The desired state of world (DSW) and the actual state of world (ASW).
//!
//! The DSW says which pods need which volumes; only the populator (and the library API acting as
//! a pod source) changes it. The ASW says what is attached, globally mounted and set up for each
//! pod; only operation results (and, at start, reconstruction) change it. Both are plain values
//! here; the manager wraps each in a lock with a single writer.
//!
//! Uncertain states are first class: an operation that timed out or was interrupted leaves its
//! volume uncertain, never unmounted, so that teardown still happens for it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, Pod, Volume};

use crate::names::{PodRef, PodUid, SharedStr, UniqueVolumeName};

/// A pod's `spec.volumes[]` entry, read in place in the pod it belongs to (one copy of the pod,
/// not one more of each of its volumes: a `Volume` value is about 3.2 KB, nearly all of it the
/// empty fields of the volume types it is not), or owned where no pod holds it (a volume
/// rebuilt from the record or from the disk).
#[derive(Clone)]
pub struct PodVolumeRef(VolumeRepr);

#[derive(Clone)]
enum VolumeRepr {
    /// The pod and the index of the volume in its `spec.volumes` (checked when made).
    InPod(Arc<Pod>, usize),
    Owned(Arc<Volume>),
}

fn pod_volumes(pod: &Pod) -> &[Volume] {
    pod.spec
        .as_ref()
        .and_then(|s| s.volumes.as_deref())
        .unwrap_or(&[])
}

impl PodVolumeRef {
    /// The pod's `index`th volume; none if it has no volume there.
    pub fn in_pod(pod: Arc<Pod>, index: usize) -> Option<Self> {
        pod_volumes(&pod).get(index)?;
        Some(PodVolumeRef(VolumeRepr::InPod(pod, index)))
    }
}

impl std::ops::Deref for PodVolumeRef {
    type Target = Volume;

    fn deref(&self) -> &Volume {
        match &self.0 {
            // A pod behind an `Arc` does not change, and `in_pod` checked the index.
            VolumeRepr::InPod(pod, index) => &pod_volumes(pod)[*index],
            VolumeRepr::Owned(v) => v,
        }
    }
}

impl From<Volume> for PodVolumeRef {
    fn from(v: Volume) -> Self {
        PodVolumeRef(VolumeRepr::Owned(Arc::new(v)))
    }
}

impl std::fmt::Debug for PodVolumeRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

impl PartialEq for PodVolumeRef {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

/// What a plugin needs to know about one volume of one pod.
#[derive(Clone, Debug)]
pub struct VolumeSpec {
    /// The pod's `spec.volumes[]` entry.
    pub volume: PodVolumeRef,
    /// The PersistentVolume a claim resolved to, for `persistentVolumeClaim` volumes.
    pub persistent_volume: Option<Arc<PersistentVolume>>,
    /// Whether the pod uses the volume as a raw block device (`volumeDevices`).
    pub block: bool,
    /// What the manifest says of the volume beyond the API types kubevol is built with.
    pub extensions: VolumeExtensions,
    /// The SELinux file label of the pod's containers that use the volume (see
    /// [`crate::selinux`]); `None` when they ask for none or the node has no SELinux.
    pub selinux_label: Option<String>,
    /// Whether the volume is mounted with `-o context="<selinux_label>"` (its CSIDriver says
    /// `seLinuxMount`, the volume is ReadWriteOncePod or SELinuxMount is on, and the pod's
    /// `seLinuxChangePolicy` is not `Recursive`).
    pub selinux_mount: bool,
}

impl VolumeSpec {
    /// The CSI driver that serves the volume: an inline CSI volume's, or its PersistentVolume's.
    pub fn csi_driver(&self) -> Option<&str> {
        let inline = self.volume.csi.as_ref().map(|c| c.driver.as_str());
        inline.or_else(|| {
            let pv = self.persistent_volume.as_deref()?;
            Some(pv.spec.as_ref()?.csi.as_ref()?.driver.as_str())
        })
    }
}

/// Fields of a pod's volume that the API types kubevol is built with do not know, read from
/// the manifest's text and kept beside the typed volume.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolumeExtensions {
    /// `emptyDir.mode` (Kubernetes 1.37, alpha): the permission bits of the volume's directory,
    /// 0 to 0o1777.
    pub empty_dir_mode: Option<u32>,
    /// `defaultUser` of a secret, configMap, downwardAPI or projected volume (Kubernetes 1.37,
    /// alpha `AtomicWriteVolumeUserFields`): the owner of its files.
    pub default_user: Option<u32>,
    /// Each item's `user`, by source (0 but for a projected volume's sources) and item index;
    /// it takes precedence over `default_user`.
    pub item_users: BTreeMap<(usize, usize), u32>,
    /// A projected volume's `serviceAccountToken`, `clusterTrustBundle` and `podCertificate`
    /// sources' `user`, by source index.
    pub source_users: BTreeMap<usize, u32>,
    /// Every other field the types do not know, by path from the pod (`spec.volumes[0].emptyDir.x`):
    /// ignored, and reported as a warning.
    pub unknown_fields: Vec<UnknownField>,
}

/// A field an object sets that kubevol's API types do not have (a misspelt field, or one newer
/// than the types): ignored, and reported as a warning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownField {
    /// Its path from the object's root, as kubectl spells it
    /// (`spec.containers[0].volumeMounts[0].readonly`).
    pub path: String,
    /// The field of the types it was probably meant to be (`readOnly`).
    pub suggestion: Option<String>,
    /// Where it is in its manifest (`line 9, column 9`), when it came from one.
    pub location: Option<String>,
}

impl std::fmt::Display for UnknownField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "unknown field {:?}", self.path)?;
        if let Some(s) = &self.suggestion {
            write!(f, " (did you mean {s:?}?)")?;
        }
        if let Some(l) = &self.location {
            write!(f, " at {l}")?;
        }
        Ok(())
    }
}

/// The [`VolumeExtensions`] of a pod's volumes, by volume name (only volumes that have some),
/// and the fields the pod sets outside its volumes that the types do not have.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodExtensions {
    /// Volume name → its extensions.
    pub volumes: BTreeMap<String, VolumeExtensions>,
    /// Unknown fields outside `spec.volumes`.
    pub unknown_fields: Vec<UnknownField>,
}

/// Static facts about a volume, decided by its plugin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeTraits {
    /// The plugin's name, e.g. `kubernetes.io/empty-dir` (one string for all its volumes: see
    /// [`SharedStr::interned`](crate::names::SharedStr::interned)).
    pub plugin: crate::names::SharedStr,
    /// Whether the volume must be attached to the node before use.
    pub attachable: bool,
    /// Whether the volume is mounted once per node (staged) before per-pod set-up.
    pub device_mountable: bool,
}

impl VolumeTraits {
    /// Whether the volume is the node's as a whole (attached or staged), so reported in the
    /// Node's `status.volumesInUse`.
    pub fn node_wide(&self) -> bool {
        self.attachable || self.device_mountable
    }
}

/// The pods of one volume, by UID, in UID order: a sorted vector. Nearly every volume has
/// one pod (each per-pod volume, as an emptyDir, is its own), where a B-tree's first node
/// would reserve room for eleven.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodMap<V>(Vec<(PodUid, V)>);

impl<V> Default for PodMap<V> {
    fn default() -> Self {
        PodMap(Vec::new())
    }
}

type Entry<V> = (PodUid, V);

impl<V> PodMap<V> {
    fn find(&self, uid: &PodUid) -> Result<usize, usize> {
        self.0.binary_search_by(|(p, _)| p.cmp(uid))
    }

    /// The pod's value.
    pub fn get(&self, uid: &PodUid) -> Option<&V> {
        self.find(uid).ok().map(|i| &self.0[i].1)
    }

    /// The pod's value, to change.
    pub fn get_mut(&mut self, uid: &PodUid) -> Option<&mut V> {
        self.find(uid).ok().map(|i| &mut self.0[i].1)
    }

    /// Whether the pod is there.
    pub fn contains_key(&self, uid: &PodUid) -> bool {
        self.find(uid).is_ok()
    }

    /// Sets the pod's value; returns the one it replaces.
    pub fn insert(&mut self, uid: PodUid, value: V) -> Option<V> {
        match self.find(&uid) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, value)),
            Err(i) => {
                // The first pod gets room for one, not the vector's usual four: most volumes
                // never have a second.
                if self.0.capacity() == 0 {
                    self.0.reserve_exact(1);
                }
                self.0.insert(i, (uid, value));
                None
            }
        }
    }

    /// Removes the pod; returns its value.
    pub fn remove(&mut self, uid: &PodUid) -> Option<V> {
        let i = self.find(uid).ok()?;
        let (_, v) = self.0.remove(i);
        if self.0.is_empty() {
            self.0 = Vec::new();
        }
        Some(v)
    }

    /// How many pods.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The pods and their values, in UID order.
    pub fn iter(&self) -> impl Iterator<Item = (&PodUid, &V)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    /// The same, to change the values.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&PodUid, &mut V)> {
        self.0.iter_mut().map(|(k, v)| (&*k, v))
    }

    /// The pods, in UID order.
    pub fn keys(&self) -> impl Iterator<Item = &PodUid> {
        self.0.iter().map(|(k, _)| k)
    }

    /// The values, in UID order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.0.iter().map(|(_, v)| v)
    }
}

impl<V> IntoIterator for PodMap<V> {
    type Item = Entry<V>;
    type IntoIter = std::vec::IntoIter<Entry<V>>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

impl<'a, V> IntoIterator for &'a PodMap<V> {
    type Item = (&'a PodUid, &'a V);
    type IntoIter =
        std::iter::Map<std::slice::Iter<'a, Entry<V>>, fn(&'a Entry<V>) -> (&'a PodUid, &'a V)>;

    fn into_iter(self) -> Self::IntoIter {
        fn pair<V>((k, v): &Entry<V>) -> (&PodUid, &V) {
            (k, v)
        }
        self.0
            .iter()
            .map(pair as fn(&'a Entry<V>) -> (&'a PodUid, &'a V))
    }
}

impl<V> FromIterator<Entry<V>> for PodMap<V> {
    fn from_iter<I: IntoIterator<Item = Entry<V>>>(iter: I) -> Self {
        let mut map = PodMap::default();
        for (k, v) in iter {
            map.insert(k, v);
        }
        map
    }
}

/// One pod's wish for one volume.
#[derive(Clone, Debug)]
pub struct DesiredPodVolume {
    /// The pod.
    pub pod_ref: PodRef,
    /// The whole pod, for plugins that read its labels, limits or security context.
    pub pod: Arc<Pod>,
    /// The volume's name in the pod's spec.
    pub outer_volume_name: SharedStr,
    /// The volume as the pod declares it.
    pub spec: Arc<VolumeSpec>,
    /// Bumped when the volume's content must be written again (a remount).
    pub content_generation: u64,
}

/// A volume some pod needs.
#[derive(Clone, Debug)]
pub struct DesiredVolume {
    /// The volume's key.
    pub name: UniqueVolumeName,
    /// Its plugin's facts.
    pub traits: VolumeTraits,
    /// Whether the node has reported the volume as in use (guards detach in cluster mode).
    pub reported_in_use: bool,
    /// The pods that need it.
    pub pods: PodMap<DesiredPodVolume>,
}

/// A pod the DSW knows, with the volumes it expects.
#[derive(Clone, Debug)]
pub struct DesiredPod {
    /// The pod.
    pub pod_ref: PodRef,
    /// Outer volume name → unique name, for every volume that was processed.
    pub volumes: BTreeMap<SharedStr, UniqueVolumeName>,
    /// Outer volume name → why it could not be processed (unsupported type, bad reference).
    pub failed_to_process: BTreeMap<String, ProcessFailure>,
}

/// Why the populator could not turn one of a pod's volumes into a wish. Nothing is retried:
/// the volume is processed again when the pod or an object it reads changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessFailure {
    /// What is wrong and what to fix.
    pub message: String,
    /// The volume is of a type kubevol does not mount (as opposed to a reference that cannot
    /// be resolved yet: a missing claim, an unbound one, a volume of another node).
    pub unsupported: bool,
    /// Nothing is wrong yet: an object the volume reads is still to be delivered by the API
    /// server (its watch has not listed it). The volume is processed once it has been.
    pub waiting: bool,
}

/// One volume a pod wants, as the populator hands it to [`DesiredState::set_pod`].
#[derive(Clone, Debug)]
pub struct PodVolumeWish {
    /// The volume's key.
    pub name: UniqueVolumeName,
    /// Its plugin's facts.
    pub traits: VolumeTraits,
    /// The pod's use of it.
    pub pod_volume: DesiredPodVolume,
}

/// The desired state of world.
#[derive(Clone, Debug, Default)]
pub struct DesiredState {
    /// By unique name: a hash map, as every operation looks its volume up several times, and
    /// the names share long prefixes (`kubernetes.io/empty-dir/<pod uid>-`) that a sorted
    /// map compares again at every level. Boxed, as the actual state's (see there).
    volumes: crate::collections::HashMap<UniqueVolumeName, Box<DesiredVolume>>,
    /// The names of the node-wide volumes among them ([`VolumeTraits::node_wide`]): the Node's
    /// report of volumes in use is read on every change, and must not look at every volume.
    node_wide: std::collections::BTreeSet<UniqueVolumeName>,
    pods: BTreeMap<PodUid, DesiredPod>,
    /// Pods not wanted whose volumes are nevertheless kept (their definition cannot be read
    /// now), and why.
    held: BTreeMap<PodUid, String>,
}

impl DesiredState {
    /// Keeps exactly these pods' volumes from being torn down while no pod wants them; returns
    /// the pods whose hold was added or released.
    pub fn set_held(&mut self, held: BTreeMap<PodUid, String>) -> Vec<PodUid> {
        let changed = self
            .held
            .keys()
            .filter(|u| !held.contains_key(*u))
            .chain(held.keys().filter(|u| !self.held.contains_key(*u)))
            .cloned()
            .collect();
        self.held = held;
        changed
    }

    /// Why a pod's volumes are kept though no pod wants them, if they are.
    pub fn held(&self, uid: &PodUid) -> Option<&str> {
        self.held.get(uid).map(String::as_str)
    }

    /// Every held pod, and why.
    pub fn held_pods(&self) -> &BTreeMap<PodUid, String> {
        &self.held
    }

    /// Replaces everything the DSW knows about one pod.
    pub fn set_pod(
        &mut self,
        pod_ref: PodRef,
        wishes: Vec<PodVolumeWish>,
        failed_to_process: BTreeMap<String, ProcessFailure>,
    ) {
        let uid = pod_ref.uid.clone();
        let mut volumes = BTreeMap::new();
        for w in &wishes {
            volumes.insert(w.pod_volume.outer_volume_name.clone(), w.name.clone());
        }
        if let Some(old) = self.pods.get(&uid) {
            let wanted: std::collections::BTreeSet<&UniqueVolumeName> = volumes.values().collect();
            let stale: Vec<UniqueVolumeName> = old
                .volumes
                .values()
                .filter(|n| !wanted.contains(n))
                .cloned()
                .collect();
            for name in stale {
                self.remove_pod_from_volume(&name, &uid);
            }
        }
        for w in wishes {
            let entry = self.volumes.entry(w.name.clone()).or_insert_with(|| {
                Box::new(DesiredVolume {
                    name: w.name.clone(),
                    traits: w.traits.clone(),
                    reported_in_use: false,
                    pods: PodMap::default(),
                })
            });
            entry.traits = w.traits;
            if entry.traits.node_wide() {
                self.node_wide.insert(w.name.clone());
            } else {
                self.node_wide.remove(&w.name);
            }
            entry.pods.insert(uid.clone(), w.pod_volume);
        }
        self.pods.insert(
            uid,
            DesiredPod {
                pod_ref,
                volumes,
                failed_to_process,
            },
        );
    }

    fn remove_pod_from_volume(&mut self, name: &UniqueVolumeName, uid: &PodUid) {
        if let Some(v) = self.volumes.get_mut(name) {
            v.pods.remove(uid);
            if v.pods.is_empty() {
                self.volumes.remove(name);
                self.node_wide.remove(name);
            }
        }
    }

    /// Forgets a pod: its volumes are no longer wanted by it.
    pub fn remove_pod(&mut self, uid: &PodUid) -> bool {
        let Some(pod) = self.pods.remove(uid) else {
            return false;
        };
        for name in pod.volumes.values() {
            self.remove_pod_from_volume(name, uid);
        }
        true
    }

    /// Marks volumes as reported in use by the node; others lose the mark.
    pub fn mark_reported_in_use(&mut self, names: &[UniqueVolumeName]) {
        for v in self.volumes.values_mut() {
            v.reported_in_use = names.contains(&v.name);
        }
    }

    /// Every desired volume, in no particular order.
    pub fn volumes(&self) -> impl Iterator<Item = &DesiredVolume> {
        self.volumes.values().map(|v| &**v)
    }

    /// The names of the desired node-wide volumes, in order.
    pub fn node_wide_volumes(&self) -> impl Iterator<Item = &UniqueVolumeName> {
        self.node_wide.iter()
    }

    /// One desired volume.
    pub fn volume(&self, name: &UniqueVolumeName) -> Option<&DesiredVolume> {
        self.volumes.get(name).map(|v| &**v)
    }

    /// One pod's wish for one volume.
    pub fn pod_volume(&self, name: &UniqueVolumeName, uid: &PodUid) -> Option<&DesiredPodVolume> {
        self.volumes.get(name).and_then(|v| v.pods.get(uid))
    }

    /// How many pods are desired.
    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }

    /// Every desired pod.
    pub fn pods(&self) -> impl Iterator<Item = &DesiredPod> {
        self.pods.values()
    }

    /// One desired pod.
    pub fn pod(&self, uid: &PodUid) -> Option<&DesiredPod> {
        self.pods.get(uid)
    }
}

/// How far a pod's use of a volume got.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum PodMountState {
    /// Set up and verified.
    Mounted,
    /// An operation may or may not have set it up (timed out, interrupted, partly failed).
    Uncertain,
}

/// How far the node-wide (device) mount of a volume got.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DeviceMountState {
    /// Not globally mounted.
    NotMounted,
    /// May or may not be globally mounted.
    Uncertain,
    /// Globally mounted.
    Mounted,
}

/// One pod's use of a volume, as it is on the node.
#[derive(Clone, Debug)]
pub struct MountedPodVolume {
    /// The pod.
    pub pod_ref: PodRef,
    /// The volume's name in the pod's spec.
    pub outer_volume_name: SharedStr,
    /// The spec it was set up from (teardown needs the same facts).
    pub spec: Arc<VolumeSpec>,
    /// How far set-up got.
    pub state: PodMountState,
    /// The path handed to the container runtime.
    pub path: PathBuf,
    /// Whether the runtime must mount it read-only.
    pub read_only: bool,
    /// The content generation that was written.
    pub content_generation: u64,
    /// The subPath mounts made for the pod's containers.
    pub sub_paths: Vec<SubPathMount>,
}

/// A subPath bind mount made for one of a container's volumeMounts.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SubPathMount {
    /// The container.
    pub container: String,
    /// The mount's index in the container's volumeMounts.
    pub index: usize,
    /// The subPath, expanded.
    pub sub_path: String,
    /// The bind mount the runtime mounts into the container instead of the volume.
    pub path: PathBuf,
}

/// A volume as it is on the node.
#[derive(Clone, Debug)]
pub struct ActualVolume {
    /// The volume's key.
    pub name: UniqueVolumeName,
    /// Its plugin's facts.
    pub traits: VolumeTraits,
    /// Whether it is attached (always true for volumes that need no attach once known).
    pub attached: bool,
    /// An attach was interrupted or timed out: it may have attached the volume, so it must
    /// be attached again (if wanted) or detached (if not), never forgotten.
    pub attach_uncertain: bool,
    /// What attach returned for the later steps (a CSI driver's publish context).
    pub publish_context: BTreeMap<String, String>,
    /// The spec the volume was attached or mounted with: node-wide teardown needs it after
    /// the last pod is gone.
    pub spec: Option<Arc<VolumeSpec>>,
    /// The node-wide mount state.
    pub device_state: DeviceMountState,
    /// Where it is globally mounted, if it is.
    pub device_mount_path: Option<PathBuf>,
    /// The pods it is set up for.
    pub pods: PodMap<MountedPodVolume>,
}

/// What reconstruction found of a volume's node-wide state.
#[derive(Clone, Debug, Default)]
pub struct ReconstructedDevice {
    /// An attach may have happened (recorded, or an intent was).
    pub attach: bool,
    /// The attach is recorded as done: it is trusted, as the external-attacher trusts its
    /// VolumeAttachment, and not made again (an interrupted one is uncertain, and is).
    pub attach_done: bool,
    /// A device mount (CSI stage) may be in place.
    pub device: bool,
    /// Where.
    pub device_mount_path: Option<PathBuf>,
    /// What attach returned, if recorded.
    pub publish_context: BTreeMap<String, String>,
    /// The spec the volume was set up with, if known.
    pub spec: Option<Arc<VolumeSpec>>,
}

/// The actual state of world.
#[derive(Clone, Debug, Default)]
pub struct ActualState {
    /// By unique name (a hash map, as the desired state's). Boxed: a table has up to twice as
    /// many buckets as volumes, and while it grows the old and new tables are both live, so a
    /// bucket of the name and a pointer (24 bytes) instead of the name and the volume (144)
    /// saves about a megabyte at 4,000 volumes.
    volumes: crate::collections::HashMap<UniqueVolumeName, Box<ActualVolume>>,
    /// The names of the node-wide volumes among them, as the desired state's.
    node_wide: std::collections::BTreeSet<UniqueVolumeName>,
    /// Pod → the volumes it has on the node, so per-pod questions never scan every volume.
    by_pod: BTreeMap<PodUid, std::collections::BTreeSet<UniqueVolumeName>>,
    /// Pod → how many of its volumes are [`PodMountState::Mounted`], so that "is the pod
    /// ready?" is answered without a look at each volume until the count says it may be.
    mounted_by_pod: crate::collections::HashMap<PodUid, usize>,
}

impl ActualState {
    fn entry(&mut self, name: &UniqueVolumeName, traits: &VolumeTraits) -> &mut ActualVolume {
        let node_wide = &mut self.node_wide;
        self.volumes.entry(name.clone()).or_insert_with(|| {
            if traits.node_wide() {
                node_wide.insert(name.clone());
            }
            Box::new(ActualVolume {
                name: name.clone(),
                traits: traits.clone(),
                attached: !traits.attachable,
                attach_uncertain: false,
                publish_context: BTreeMap::new(),
                spec: None,
                device_state: DeviceMountState::NotMounted,
                device_mount_path: None,
                pods: PodMap::default(),
            })
        })
    }

    /// Records a successful attach.
    pub fn mark_attached(
        &mut self,
        name: &UniqueVolumeName,
        traits: &VolumeTraits,
        publish_context: BTreeMap<String, String>,
        spec: Arc<VolumeSpec>,
    ) {
        let v = self.entry(name, traits);
        v.attached = true;
        v.attach_uncertain = false;
        v.publish_context = publish_context;
        v.spec = Some(spec);
    }

    /// Records an attach that may or may not have attached the volume.
    pub fn mark_attach_uncertain(
        &mut self,
        name: &UniqueVolumeName,
        traits: &VolumeTraits,
        spec: Arc<VolumeSpec>,
    ) {
        let v = self.entry(name, traits);
        if !v.attached {
            v.attach_uncertain = true;
            v.spec = Some(spec);
        }
    }

    /// Records what reconstruction found of a volume's node-wide state: everything found is
    /// uncertain until an operation verifies it (attached again or detached, staged again or
    /// unstaged).
    pub fn mark_reconstructed_device(
        &mut self,
        name: &UniqueVolumeName,
        traits: &VolumeTraits,
        found: ReconstructedDevice,
    ) {
        let v = self.entry(name, traits);
        if traits.attachable && found.attach {
            v.attached = found.attach_done;
            v.attach_uncertain = !found.attach_done;
        }
        if found.device {
            v.device_state = DeviceMountState::Uncertain;
        }
        if found.device_mount_path.is_some() {
            v.device_mount_path = found.device_mount_path;
        }
        if !found.publish_context.is_empty() {
            v.publish_context = found.publish_context;
        }
        if v.spec.is_none() {
            v.spec = found.spec;
        }
        self.forget_if_unused(name);
    }

    /// Records the outcome of a mount-device operation.
    pub fn mark_device_state(
        &mut self,
        name: &UniqueVolumeName,
        traits: &VolumeTraits,
        state: DeviceMountState,
        path: Option<PathBuf>,
        spec: Arc<VolumeSpec>,
    ) {
        let v = self.entry(name, traits);
        v.device_state = state;
        v.spec = Some(spec);
        if path.is_some() {
            v.device_mount_path = path;
        }
        self.forget_if_unused(name);
    }

    /// Records a pod's volume as set up (or uncertain).
    pub fn mark_pod_volume(
        &mut self,
        name: &UniqueVolumeName,
        traits: &VolumeTraits,
        uid: PodUid,
        mounted: MountedPodVolume,
    ) {
        self.by_pod
            .entry(uid.clone())
            .or_default()
            .insert(name.clone());
        let now = mounted.state;
        let was = self
            .entry(name, traits)
            .pods
            .insert(uid.clone(), mounted)
            .map(|m| m.state);
        self.count_mounted(&uid, was, Some(now));
    }

    /// Keeps [`ActualState::mounted_count`] right across one pod volume's change of state.
    fn count_mounted(
        &mut self,
        uid: &PodUid,
        was: Option<PodMountState>,
        now: Option<PodMountState>,
    ) {
        let mounted = |s: Option<PodMountState>| s == Some(PodMountState::Mounted);
        match (mounted(was), mounted(now)) {
            (false, true) => *self.mounted_by_pod.entry(uid.clone()).or_default() += 1,
            (true, false) => {
                if let Some(n) = self.mounted_by_pod.get_mut(uid) {
                    *n -= 1;
                    if *n == 0 {
                        self.mounted_by_pod.remove(uid);
                    }
                }
            }
            _ => {}
        }
    }

    /// How many of a pod's volumes are set up and verified.
    pub fn mounted_count(&self, uid: &PodUid) -> usize {
        self.mounted_by_pod.get(uid).copied().unwrap_or(0)
    }

    /// Changes how far a pod's use of a volume got (e.g. to uncertain after a failed teardown).
    pub fn set_pod_state(&mut self, name: &UniqueVolumeName, uid: &PodUid, state: PodMountState) {
        let was = match self.volumes.get_mut(name).and_then(|v| v.pods.get_mut(uid)) {
            Some(m) => std::mem::replace(&mut m.state, state),
            None => return,
        };
        self.count_mounted(uid, Some(was), Some(state));
    }

    /// Records a pod's volume as torn down.
    pub fn mark_pod_unmounted(&mut self, name: &UniqueVolumeName, uid: &PodUid) {
        if let Some(v) = self.volumes.get_mut(name) {
            let was = v.pods.remove(uid).map(|m| m.state);
            self.count_mounted(uid, was, None);
        }
        if let Some(set) = self.by_pod.get_mut(uid) {
            set.remove(name);
            if set.is_empty() {
                self.by_pod.remove(uid);
            }
        }
        self.forget_if_unused(name);
    }

    /// Records a detach: the volume is gone from the node.
    pub fn mark_detached(&mut self, name: &UniqueVolumeName) {
        if let Some(v) = self.volumes.get_mut(name) {
            v.attached = false;
            v.attach_uncertain = false;
        }
        self.forget_if_unused(name);
    }

    /// A volume that needs no detach and has nothing mounted is no longer on the node.
    fn forget_if_unused(&mut self, name: &UniqueVolumeName) {
        let gone = self.volumes.get(name).is_some_and(|v| {
            v.pods.is_empty()
                && v.device_state == DeviceMountState::NotMounted
                && (!v.traits.attachable || !(v.attached || v.attach_uncertain))
        });
        if gone {
            self.volumes.remove(name);
            self.node_wide.remove(name);
        }
    }

    /// Every volume on the node, in no particular order.
    pub fn volumes(&self) -> impl Iterator<Item = &ActualVolume> {
        self.volumes.values().map(|v| &**v)
    }

    /// The names of the node-wide volumes on the node, in order.
    pub fn node_wide_volumes(&self) -> impl Iterator<Item = &UniqueVolumeName> {
        self.node_wide.iter()
    }

    /// One volume on the node.
    pub fn volume(&self, name: &UniqueVolumeName) -> Option<&ActualVolume> {
        self.volumes.get(name).map(|v| &**v)
    }

    /// One pod's use of one volume.
    pub fn pod_volume(&self, name: &UniqueVolumeName, uid: &PodUid) -> Option<&MountedPodVolume> {
        self.volumes.get(name).and_then(|v| v.pods.get(uid))
    }

    /// Every volume a pod has on the node (mounted or uncertain), with its unique name.
    pub fn pod_volumes<'a>(
        &'a self,
        uid: &'a PodUid,
    ) -> impl Iterator<Item = (&'a UniqueVolumeName, &'a MountedPodVolume)> + 'a {
        self.by_pod
            .get(uid)
            .into_iter()
            .flatten()
            .filter_map(move |n| self.volumes.get_key_value(n))
            .filter_map(move |(n, v)| v.pods.get(uid).map(|p| (n, p)))
    }

    /// Every pod that has something on the node.
    pub fn pods(&self) -> impl Iterator<Item = &PodUid> {
        self.by_pod.keys()
    }
}

#[cfg(test)]
mod tests;
