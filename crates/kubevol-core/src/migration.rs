//! CSI migration: volumes of the in-tree cloud types, served by their CSI drivers after the
//! translation Kubernetes applies (its CSI translation library, 1.36), so that the unique
//! names, volume handles and attributes — and with them `volumesInUse` and the names of
//! VolumeAttachments — are the ones the cluster's controllers compute.
//!
//! A PersistentVolume keeps everything but its source, which becomes `spec.csi`; its zone
//! topology is rewritten to the driver's key. An inline volume becomes a PersistentVolume of
//! its own, named as the library names it (unique per disk: it names the staging paths).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
    PersistentVolume, PersistentVolumeSpec, SecretReference, Volume, VolumeNodeAffinity,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// An in-tree type served through CSI: its field, its plugin's name and its driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InTree {
    /// The volume source's field (`gcePersistentDisk`).
    pub field: &'static str,
    /// The in-tree plugin's name (`kubernetes.io/gce-pd`).
    pub plugin: &'static str,
    /// The CSI driver that serves it.
    pub driver: &'static str,
}

const GCE_PD: InTree = InTree {
    field: "gcePersistentDisk",
    plugin: "kubernetes.io/gce-pd",
    driver: "pd.csi.storage.gke.io",
};
const AWS_EBS: InTree = InTree {
    field: "awsElasticBlockStore",
    plugin: "kubernetes.io/aws-ebs",
    driver: "ebs.csi.aws.com",
};
const AZURE_DISK: InTree = InTree {
    field: "azureDisk",
    plugin: "kubernetes.io/azure-disk",
    driver: "disk.csi.azure.com",
};
const AZURE_FILE: InTree = InTree {
    field: "azureFile",
    plugin: "kubernetes.io/azure-file",
    driver: "file.csi.azure.com",
};
const CINDER: InTree = InTree {
    field: "cinder",
    plugin: "kubernetes.io/cinder",
    driver: "cinder.csi.openstack.org",
};
const VSPHERE: InTree = InTree {
    field: "vsphereVolume",
    plugin: "kubernetes.io/vsphere-volume",
    driver: "csi.vsphere.vmware.com",
};
const PORTWORX: InTree = InTree {
    field: "portworxVolume",
    plugin: "kubernetes.io/portworx-volume",
    driver: "pxd.portworx.com",
};

/// Every in-tree type kubevol serves through CSI (all of them are migrated in Kubernetes 1.36).
pub const IN_TREE: [InTree; 7] = [
    AWS_EBS, AZURE_DISK, AZURE_FILE, CINDER, GCE_PD, PORTWORX, VSPHERE,
];

/// The CSINode annotation that tells the attach/detach controller which in-tree plugins this
/// node serves through CSI.
pub const MIGRATED_PLUGINS_ANNOTATION: &str = "storage.alpha.kubernetes.io/migrated-plugins";

/// The annotation's value: the plugins' names, sorted, comma-separated (as the kubelet writes it).
pub fn migrated_plugins() -> String {
    let names: BTreeSet<&str> = IN_TREE.iter().map(|t| t.plugin).collect();
    names.into_iter().collect::<Vec<_>>().join(",")
}

const ZONE: &str = "topology.kubernetes.io/zone";
const REGION: &str = "topology.kubernetes.io/region";
const BETA_ZONE: &str = "failure-domain.beta.kubernetes.io/zone";
const BETA_REGION: &str = "failure-domain.beta.kubernetes.io/region";
/// How a PV label lists several zones.
const ZONES_DELIMITER: &str = "__";
const UNSPECIFIED: &str = "UNSPECIFIED";

/// The in-tree type of a PersistentVolume, if it is one served through CSI.
pub fn in_tree_of_pv(pv: &PersistentVolume) -> Option<InTree> {
    let s = pv.spec.as_ref()?;
    [
        (s.gce_persistent_disk.is_some(), GCE_PD),
        (s.aws_elastic_block_store.is_some(), AWS_EBS),
        (s.azure_disk.is_some(), AZURE_DISK),
        (s.azure_file.is_some(), AZURE_FILE),
        (s.cinder.is_some(), CINDER),
        (s.vsphere_volume.is_some(), VSPHERE),
        (s.portworx_volume.is_some(), PORTWORX),
    ]
    .into_iter()
    .find_map(|(set, t)| set.then_some(t))
}

/// The in-tree type of a pod's inline volume, if it is one served through CSI.
pub fn in_tree_of_volume(v: &Volume) -> Option<InTree> {
    [
        (v.gce_persistent_disk.is_some(), GCE_PD),
        (v.aws_elastic_block_store.is_some(), AWS_EBS),
        (v.azure_disk.is_some(), AZURE_DISK),
        (v.azure_file.is_some(), AZURE_FILE),
        (v.cinder.is_some(), CINDER),
        (v.vsphere_volume.is_some(), VSPHERE),
        (v.portworx_volume.is_some(), PORTWORX),
    ]
    .into_iter()
    .find_map(|(set, t)| set.then_some(t))
}

/// `Some(s)` unless `s` is empty (the API's omitted string).
fn some(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_string())
}

fn csi(driver: &str, handle: String) -> CSIPersistentVolumeSource {
    CSIPersistentVolumeSource {
        driver: driver.to_string(),
        volume_handle: handle,
        ..Default::default()
    }
}

fn attributes(pairs: &[(&str, String)]) -> Option<BTreeMap<String, String>> {
    Some(
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    )
}

/// A partition number as the library writes it for GCE PD: empty for 0.
fn gce_partition(p: Option<i32>) -> String {
    match p.unwrap_or(0) {
        0 => String::new(),
        n => n.to_string(),
    }
}

/// The EBS volume ID of an in-tree volume ID (`aws://<zone>/vol-…` or a bare `vol-…`).
fn ebs_volume_id(id: &str) -> Result<String, String> {
    let Some(rest) = id.strip_prefix("aws://") else {
        return Ok(id.to_string());
    };
    let path = rest.split_once('/').map_or("", |(_, p)| p);
    let volume = path.trim_matches('/');
    let valid = volume.starts_with("vol-") && !volume.contains('/');
    if !valid {
        return Err(format!("Invalid format for AWS volume ({id})"));
    }
    Ok(volume.to_string())
}

/// The storage account of an Azure file volume's Secret (`azure-storage-account-<account>-secret`),
/// or the Secret's name when it is not of that form.
fn azure_account(secret: &str) -> String {
    const PREFIX: &str = "azure-storage-account-";
    const SUFFIX: &str = "-secret";
    // The library's unanchored, greedy match: the first prefix, the last suffix after it.
    secret
        .find(PREFIX)
        .map(|i| &secret[i + PREFIX.len()..])
        .and_then(|rest| rest.rfind(SUFFIX).map(|j| &rest[..j]))
        .filter(|account| !account.is_empty())
        .map_or_else(|| secret.to_string(), str::to_string)
}

/// The GCE region of a set of zones (`<locale>-<region>-<zone>`), which must agree.
fn gce_region(zones: &[&str]) -> Result<String, String> {
    let mut regions = BTreeSet::new();
    for z in zones {
        let parts: Vec<&str> = z.split('-').collect();
        if parts.len() != 3 {
            return Err(format!(
                "zone in unexpected format, expected: {{locale}}-{{region}}-{{zone}}, got: {z}"
            ));
        }
        regions.insert(parts[..2].join("-"));
    }
    match (regions.len(), regions.into_iter().next()) {
        (1, Some(r)) => Ok(r),
        _ => Err(format!(
            "multiple or no regions gotten from zones, got: {zones:?}"
        )),
    }
}

/// The access modes the library leaves a GCE PD volume with: ReadWriteMany (which in-tree
/// treated as ReadWriteOnce) and ReadOnlyMany with ReadWriteOnce become ReadWriteOnce.
fn backward_compatible_modes(modes: Option<&Vec<String>>) -> Option<Vec<String>> {
    let modes = modes?;
    let set: BTreeSet<&str> = modes
        .iter()
        .map(|m| match m.as_str() {
            "ReadWriteMany" => "ReadWriteOnce",
            m => m,
        })
        .collect();
    let one = if set.contains("ReadWriteOnce") || !set.contains("ReadOnlyMany") {
        "ReadWriteOnce"
    } else {
        "ReadOnlyMany"
    };
    Some(vec![one.to_string()])
}

fn terms(pv: &PersistentVolume) -> &[NodeSelectorTerm] {
    pv.spec
        .as_ref()
        .and_then(|s| s.node_affinity.as_ref())
        .and_then(|a| a.required.as_ref())
        .map_or(&[], |r| r.node_selector_terms.as_slice())
}

fn key_in_affinity(pv: &PersistentVolume, key: &str) -> bool {
    terms(pv)
        .iter()
        .flat_map(|t| t.match_expressions.iter().flatten())
        .any(|r| r.key == key)
}

fn label<'a>(pv: &'a PersistentVolume, key: &str) -> Option<&'a String> {
    pv.metadata.labels.as_ref()?.get(key)
}

/// The zone and region labels a PV uses: the GA ones unless only the beta ones are there.
fn topology_labels(pv: &PersistentVolume) -> (&'static str, &'static str) {
    let beta = !key_in_affinity(pv, ZONE)
        && (key_in_affinity(pv, BETA_ZONE)
            || (label(pv, ZONE).is_none() && label(pv, BETA_ZONE).is_some()));
    if beta {
        (BETA_ZONE, BETA_REGION)
    } else {
        (ZONE, REGION)
    }
}

/// Every value of `key` in the PV's node affinity.
fn affinity_values(pv: &PersistentVolume, key: &str) -> BTreeSet<String> {
    terms(pv)
        .iter()
        .flat_map(|t| t.match_expressions.iter().flatten())
        .filter(|r| r.key == key)
        .flat_map(|r| r.values.iter().flatten().cloned())
        .collect()
}

fn required_mut(pv: &mut PersistentVolume) -> &mut NodeSelector {
    let spec = pv.spec.get_or_insert_with(Default::default);
    spec.node_affinity
        .get_or_insert_with(VolumeNodeAffinity::default)
        .required
        .get_or_insert_with(NodeSelector::default)
}

fn replace_key(pv: &mut PersistentVolume, old: &str, new: &str) {
    if terms(pv).is_empty() {
        return;
    }
    for t in &mut required_mut(pv).node_selector_terms {
        for r in t.match_expressions.iter_mut().flatten() {
            if r.key == old {
                r.key = new.to_string();
            }
        }
    }
}

/// Adds `key In zones` to every term (one term if there is none).
fn add_topology(pv: &mut PersistentVolume, key: &str, zones: &[&str]) {
    let zones: BTreeSet<String> = zones
        .iter()
        .map(|z| z.trim())
        .filter(|z| !z.is_empty())
        .map(String::from)
        .collect();
    if zones.is_empty() {
        return;
    }
    let required = required_mut(pv);
    if required.node_selector_terms.is_empty() {
        required
            .node_selector_terms
            .push(NodeSelectorTerm::default());
    }
    for t in &mut required.node_selector_terms {
        t.match_expressions
            .get_or_insert_with(Vec::new)
            .push(NodeSelectorRequirement {
                key: key.to_string(),
                operator: "In".into(),
                values: Some(zones.iter().cloned().collect()),
            });
    }
}

/// The zone topology of a PV, moved to the driver's key (from its node affinity, else its
/// zone label); a beta region key becomes the GA one.
fn translate_topology(pv: &mut PersistentVolume, csi_key: &str) {
    let (zone, region) = topology_labels(pv);
    if !affinity_values(pv, zone).is_empty() {
        replace_key(pv, zone, csi_key);
    } else if let Some(l) = label(pv, zone).cloned() {
        let zones: Vec<&str> = l.split(ZONES_DELIMITER).collect();
        add_topology(pv, csi_key, &zones);
    }
    if region == BETA_REGION && !affinity_values(pv, region).is_empty() {
        replace_key(pv, region, REGION);
    }
}

/// vSphere's topology: zone and region each moved to the driver's keys.
fn translate_vsphere_topology(pv: &mut PersistentVolume) {
    let (zone, region) = topology_labels(pv);
    for (from, to) in [
        (zone, "topology.csi.vmware.com/zone"),
        (region, "topology.csi.vmware.com/region"),
    ] {
        if !affinity_values(pv, from).is_empty() {
            replace_key(pv, from, to);
        } else if let Some(l) = label(pv, from).filter(|l| !l.is_empty()).cloned() {
            add_topology(pv, to, &[l.as_str()]);
        }
    }
}

/// The PersistentVolume an in-tree PersistentVolume is served as, if it is of an in-tree type
/// served through CSI; an error says why one cannot be translated.
pub fn translate_pv(pv: &PersistentVolume) -> Option<Result<PersistentVolume, String>> {
    let t = in_tree_of_pv(pv)?;
    let spec = pv.spec.as_ref()?;
    let source = match translate_source(t, pv, spec) {
        Ok(s) => s,
        Err(e) => return Some(Err(e)),
    };
    let mut out = pv.clone();
    let spec = out.spec.get_or_insert_with(Default::default);
    // The in-tree source is replaced by the CSI one (a PV has exactly one).
    (
        spec.gce_persistent_disk,
        spec.aws_elastic_block_store,
        spec.azure_disk,
        spec.azure_file,
        spec.cinder,
        spec.vsphere_volume,
        spec.portworx_volume,
    ) = Default::default();
    spec.csi = Some(source);
    match t {
        GCE_PD => {
            translate_topology(&mut out, "topology.gke.io/zone");
            let spec = out.spec.get_or_insert_with(Default::default);
            spec.access_modes = backward_compatible_modes(spec.access_modes.as_ref());
        }
        AWS_EBS => translate_topology(&mut out, "topology.ebs.csi.aws.com/zone"),
        CINDER => translate_topology(&mut out, "topology.cinder.csi.openstack.org/zone"),
        VSPHERE => translate_vsphere_topology(&mut out),
        _ => {}
    }
    Some(Ok(out))
}

/// The CSI source of an in-tree PersistentVolume's source.
fn translate_source(
    t: InTree,
    pv: &PersistentVolume,
    spec: &PersistentVolumeSpec,
) -> Result<CSIPersistentVolumeSource, String> {
    let name = pv.metadata.name.as_deref().unwrap_or_default();
    let annotation = |k: &str| pv.metadata.annotations.as_ref().and_then(|a| a.get(k));
    Ok(match t {
        GCE_PD => {
            let s = spec
                .gce_persistent_disk
                .as_ref()
                .ok_or("no gcePersistentDisk")?;
            let zones_label = label(pv, BETA_ZONE)
                .filter(|z| !z.is_empty())
                .or_else(|| label(pv, ZONE))
                .cloned()
                .unwrap_or_default();
            let zones: Vec<&str> = zones_label.split(ZONES_DELIMITER).collect();
            let handle = match zones.as_slice() {
                [zone] if !zone.is_empty() => {
                    format!("projects/{UNSPECIFIED}/zones/{zone}/disks/{}", s.pd_name)
                }
                [_, _, ..] => format!(
                    "projects/{UNSPECIFIED}/regions/{}/disks/{}",
                    gce_region(&zones)
                        .map_err(|e| format!("failed to get region from zones: {e}"))?,
                    s.pd_name
                ),
                _ => format!(
                    "projects/{UNSPECIFIED}/zones/{UNSPECIFIED}/disks/{}",
                    s.pd_name
                ),
            };
            CSIPersistentVolumeSource {
                read_only: s.read_only.filter(|r| *r),
                fs_type: s.fs_type.as_deref().and_then(some),
                volume_attributes: attributes(&[("partition", gce_partition(s.partition))]),
                ..csi(t.driver, handle)
            }
        }
        AWS_EBS => {
            let s = spec
                .aws_elastic_block_store
                .as_ref()
                .ok_or("no awsElasticBlockStore")?;
            let handle = ebs_volume_id(&s.volume_id)
                .map_err(|e| format!("failed to translate Kubernetes ID to EBS Volume ID {e}"))?;
            CSIPersistentVolumeSource {
                read_only: s.read_only.filter(|r| *r),
                fs_type: s.fs_type.as_deref().and_then(some),
                volume_attributes: attributes(&[(
                    "partition",
                    s.partition.unwrap_or(0).to_string(),
                )]),
                ..csi(t.driver, handle)
            }
        }
        AZURE_DISK => {
            let s = spec.azure_disk.as_ref().ok_or("no azureDisk")?;
            azure_disk(
                s.kind.as_deref(),
                s.caching_mode.as_deref(),
                s.fs_type.as_deref(),
                s.read_only,
                &s.disk_uri,
                false,
            )?
        }
        AZURE_FILE => {
            let s = spec.azure_file.as_ref().ok_or("no azureFile")?;
            let namespace = match &s.secret_namespace {
                Some(ns) => ns.clone(),
                None => spec
                    .claim_ref
                    .as_ref()
                    .and_then(|r| r.namespace.clone())
                    .unwrap_or_default(),
            };
            if namespace.is_empty() {
                return Err(
                    "could not find a secret namespace in PersistentVolumeSource or ClaimRef"
                        .into(),
                );
            }
            let group = annotation("kubernetes.io/azure-file-resource-group")
                .cloned()
                .unwrap_or_default();
            let handle = format!(
                "{group}#{}#{}#{name}#{namespace}",
                azure_account(&s.secret_name),
                s.share_name
            );
            CSIPersistentVolumeSource {
                read_only: s.read_only.filter(|r| *r),
                volume_attributes: attributes(&[("sharename", s.share_name.clone())]),
                node_stage_secret_ref: Some(SecretReference {
                    name: Some(s.secret_name.clone()),
                    namespace: Some(namespace),
                }),
                ..csi(t.driver, handle)
            }
        }
        CINDER => {
            let s = spec.cinder.as_ref().ok_or("no cinder")?;
            CSIPersistentVolumeSource {
                read_only: s.read_only.filter(|r| *r),
                fs_type: s.fs_type.as_deref().and_then(some),
                volume_attributes: Some(BTreeMap::new()),
                ..csi(t.driver, s.volume_id.clone())
            }
        }
        VSPHERE => {
            let s = spec.vsphere_volume.as_ref().ok_or("no vsphereVolume")?;
            vsphere(s)
        }
        PORTWORX => {
            let s = spec.portworx_volume.as_ref().ok_or("no portworxVolume")?;
            let secret = match (
                annotation("openstorage.io/auth-secret-name"),
                annotation("openstorage.io/auth-secret-namespace"),
            ) {
                (Some(n), Some(ns)) => Some(SecretReference {
                    name: Some(n.clone()),
                    namespace: Some(ns.clone()),
                }),
                _ => None,
            };
            CSIPersistentVolumeSource {
                fs_type: s.fs_type.as_deref().and_then(some),
                controller_publish_secret_ref: secret.clone(),
                node_stage_secret_ref: secret.clone(),
                node_publish_secret_ref: secret.clone(),
                controller_expand_secret_ref: secret.clone(),
                node_expand_secret_ref: secret,
                ..csi(t.driver, s.volume_id.clone())
            }
        }
        _ => return Err(format!("{} is not served through CSI", t.field)),
    })
}

/// An Azure disk's CSI source (only managed disks are migrated); `inline` leaves out an empty
/// caching mode, as the library does for inline volumes.
fn azure_disk(
    kind: Option<&str>,
    caching: Option<&str>,
    fs_type: Option<&str>,
    read_only: Option<bool>,
    uri: &str,
    inline: bool,
) -> Result<CSIPersistentVolumeSource, String> {
    if let Some(k) = kind.filter(|k| !k.eq_ignore_ascii_case("Managed")) {
        return Err(format!("kind({k}) is not supported in csi migration"));
    }
    let mut attrs = BTreeMap::from([("kind".to_string(), "Managed".to_string())]);
    if let Some(c) = caching.filter(|c| !inline || !c.is_empty()) {
        attrs.insert("cachingmode".into(), c.to_string());
    }
    if let Some(f) = fs_type {
        attrs.insert("fstype".into(), f.to_string());
    }
    Ok(CSIPersistentVolumeSource {
        read_only: read_only.filter(|r| *r),
        fs_type: fs_type.and_then(some),
        volume_attributes: Some(attrs),
        ..csi(AZURE_DISK.driver, uri.to_string())
    })
}

fn vsphere(
    s: &k8s_openapi::api::core::v1::VsphereVirtualDiskVolumeSource,
) -> CSIPersistentVolumeSource {
    let mut attrs = BTreeMap::new();
    if let Some(p) = s.storage_policy_name.as_deref().filter(|p| !p.is_empty()) {
        attrs.insert("storagepolicyname".to_string(), p.to_string());
    }
    CSIPersistentVolumeSource {
        fs_type: s.fs_type.as_deref().and_then(some),
        volume_attributes: Some(attrs),
        ..csi(VSPHERE.driver, s.volume_path.clone())
    }
}

/// The PersistentVolume an inline in-tree volume of a pod in `namespace` is served as, if it is
/// of an in-tree type served through CSI. Its name is the library's (`<driver>-<disk>` for
/// most types): it must be unique per disk.
pub fn translate_inline(v: &Volume, namespace: &str) -> Option<Result<PersistentVolume, String>> {
    let t = in_tree_of_volume(v)?;
    let pv = |name: String, source: CSIPersistentVolumeSource, mode: &str| PersistentVolume {
        metadata: ObjectMeta {
            name: Some(name),
            ..Default::default()
        },
        spec: Some(PersistentVolumeSpec {
            csi: Some(source),
            access_modes: Some(vec![mode.to_string()]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let out = match t {
        GCE_PD => {
            let s = v.gce_persistent_disk.as_ref()?;
            let read_only = s.read_only.unwrap_or(false);
            let source = CSIPersistentVolumeSource {
                read_only: s.read_only.filter(|r| *r),
                fs_type: s.fs_type.as_deref().and_then(some),
                volume_attributes: attributes(&[("partition", gce_partition(s.partition))]),
                ..csi(
                    t.driver,
                    format!(
                        "projects/{UNSPECIFIED}/zones/{UNSPECIFIED}/disks/{}",
                        s.pd_name
                    ),
                )
            };
            let mut p = pv(
                format!("{}-{}", t.driver, s.pd_name),
                source,
                if read_only {
                    "ReadOnlyMany"
                } else {
                    "ReadWriteOnce"
                },
            );
            if let Some(spec) = p.spec.as_mut() {
                spec.volume_mode = Some("Filesystem".into());
            }
            Ok(p)
        }
        AWS_EBS => {
            let s = v.aws_elastic_block_store.as_ref()?;
            ebs_volume_id(&s.volume_id)
                .map_err(|e| format!("failed to translate Kubernetes ID to EBS Volume ID {e}"))
                .map(|handle| {
                    let source = CSIPersistentVolumeSource {
                        read_only: s.read_only.filter(|r| *r),
                        fs_type: s.fs_type.as_deref().and_then(some),
                        volume_attributes: attributes(&[(
                            "partition",
                            s.partition.unwrap_or(0).to_string(),
                        )]),
                        ..csi(t.driver, handle.clone())
                    };
                    pv(format!("{}-{handle}", t.driver), source, "ReadWriteOnce")
                })
        }
        AZURE_DISK => {
            let s = v.azure_disk.as_ref()?;
            azure_disk(
                s.kind.as_deref(),
                s.caching_mode.as_deref(),
                s.fs_type.as_deref(),
                s.read_only,
                &s.disk_uri,
                true,
            )
            .map(|source| pv(s.disk_uri.clone(), source, "ReadWriteOnce"))
        }
        AZURE_FILE => {
            let s = v.azure_file.as_ref()?;
            let ns = if namespace.is_empty() {
                "default"
            } else {
                namespace
            };
            let handle = format!(
                "#{}#{}#{}#{ns}",
                azure_account(&s.secret_name),
                s.share_name,
                v.name
            );
            let source = CSIPersistentVolumeSource {
                read_only: s.read_only.filter(|r| *r),
                volume_attributes: attributes(&[("sharename", s.share_name.clone())]),
                node_stage_secret_ref: Some(SecretReference {
                    name: Some(s.secret_name.clone()),
                    namespace: Some(ns.to_string()),
                }),
                ..csi(t.driver, handle.clone())
            };
            Ok(pv(handle, source, "ReadWriteMany"))
        }
        CINDER => {
            let s = v.cinder.as_ref()?;
            let source = CSIPersistentVolumeSource {
                read_only: s.read_only.filter(|r| *r),
                fs_type: s.fs_type.as_deref().and_then(some),
                volume_attributes: Some(BTreeMap::new()),
                ..csi(t.driver, s.volume_id.clone())
            };
            Ok(pv(
                format!("{}-{}", t.driver, s.volume_id),
                source,
                "ReadWriteOnce",
            ))
        }
        VSPHERE => {
            let s = v.vsphere_volume.as_ref()?;
            Ok(pv(
                format!("{}-{}", t.driver, s.volume_path),
                vsphere(s),
                "ReadWriteOnce",
            ))
        }
        PORTWORX => {
            let s = v.portworx_volume.as_ref()?;
            let source = CSIPersistentVolumeSource {
                fs_type: s.fs_type.as_deref().and_then(some),
                volume_attributes: Some(BTreeMap::new()),
                ..csi(t.driver, s.volume_id.clone())
            };
            let mode = if s.read_only.unwrap_or(false) {
                "ReadOnlyMany"
            } else {
                "ReadWriteOnce"
            };
            Ok(pv(format!("{}-{}", t.driver, s.volume_id), source, mode))
        }
        _ => Err(format!("{} is not served through CSI", t.field)),
    };
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pv(v: serde_json::Value) -> PersistentVolume {
        serde_json::from_value(v).unwrap()
    }

    fn csi_of(p: &PersistentVolume) -> serde_json::Value {
        serde_json::to_value(p.spec.as_ref().unwrap().csi.as_ref().unwrap()).unwrap()
    }

    fn affinity(p: &PersistentVolume) -> serde_json::Value {
        serde_json::to_value(&p.spec.as_ref().unwrap().node_affinity).unwrap()
    }

    /// The translations of each type, as the translation library's own cases give them.
    #[test]
    fn persistent_volumes_translate_as_kubernetes_translates_them() {
        // GCE PD: zonal from the label, regional from several zones, the zone key moved.
        let zonal = translate_pv(&pv(json!({"metadata": {"name": "p", "labels": {ZONE: "us-central1-a"}},
            "spec": {"accessModes": ["ReadWriteMany"], "gcePersistentDisk": {"pdName": "d", "partition": 2, "readOnly": true},
                     "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [{"key": ZONE, "operator": "In", "values": ["us-central1-a"]}]}]}}}})))
            .unwrap()
            .unwrap();
        assert_eq!(
            csi_of(&zonal),
            json!({"driver": "pd.csi.storage.gke.io", "volumeHandle": "projects/UNSPECIFIED/zones/us-central1-a/disks/d", "readOnly": true, "volumeAttributes": {"partition": "2"}})
        );
        assert_eq!(
            zonal.spec.as_ref().unwrap().access_modes,
            Some(vec!["ReadWriteOnce".to_string()])
        );
        assert_eq!(
            affinity(&zonal),
            json!({"required": {"nodeSelectorTerms": [{"matchExpressions": [{"key": "topology.gke.io/zone", "operator": "In", "values": ["us-central1-a"]}]}]}})
        );
        assert!(zonal.spec.as_ref().unwrap().gce_persistent_disk.is_none());
        let regional = translate_pv(&pv(json!({"metadata": {"name": "p", "labels": {BETA_ZONE: "europe-west1-b__europe-west1-c"}}, "spec": {"gcePersistentDisk": {"pdName": "d"}}}))).unwrap().unwrap();
        assert_eq!(
            csi_of(&regional)["volumeHandle"],
            "projects/UNSPECIFIED/regions/europe-west1/disks/d"
        );
        assert_eq!(
            affinity(&regional),
            json!({"required": {"nodeSelectorTerms": [{"matchExpressions": [{"key": "topology.gke.io/zone", "operator": "In", "values": ["europe-west1-b", "europe-west1-c"]}]}]}}),
            "from the beta label"
        );
        let bad = translate_pv(&pv(json!({"metadata": {"name": "p", "labels": {ZONE: "a-b-c__x-y-z"}}, "spec": {"gcePersistentDisk": {"pdName": "d"}}}))).unwrap();
        assert!(bad.unwrap_err().contains("multiple or no regions"));

        // AWS EBS: the URL form stripped, the partition always written.
        let ebs = translate_pv(&pv(json!({"metadata": {"name": "p"}, "spec": {"awsElasticBlockStore": {"volumeID": "aws://us-east-1a/vol-0123", "fsType": "xfs"}}}))).unwrap().unwrap();
        assert_eq!(
            csi_of(&ebs),
            json!({"driver": "ebs.csi.aws.com", "volumeHandle": "vol-0123", "fsType": "xfs", "volumeAttributes": {"partition": "0"}})
        );
        let bad = translate_pv(&pv(json!({"metadata": {"name": "p"}, "spec": {"awsElasticBlockStore": {"volumeID": "aws://us-east-1a/disk-1"}}}))).unwrap();
        assert!(bad
            .unwrap_err()
            .contains("Invalid format for AWS volume (aws://us-east-1a/disk-1)"));

        // Azure disk: managed only.
        let disk = translate_pv(&pv(json!({"metadata": {"name": "p"}, "spec": {"azureDisk": {"diskName": "d", "diskURI": "/subscriptions/s/resourceGroups/g/providers/Microsoft.Compute/disks/d", "cachingMode": "ReadOnly", "fsType": "ext4", "kind": "Managed"}}}))).unwrap().unwrap();
        assert_eq!(
            csi_of(&disk),
            json!({"driver": "disk.csi.azure.com", "volumeHandle": "/subscriptions/s/resourceGroups/g/providers/Microsoft.Compute/disks/d", "fsType": "ext4", "volumeAttributes": {"cachingmode": "ReadOnly", "fstype": "ext4", "kind": "Managed"}})
        );
        let shared = translate_pv(&pv(json!({"metadata": {"name": "p"}, "spec": {"azureDisk": {"diskName": "d", "diskURI": "u", "kind": "Shared"}}}))).unwrap();
        assert_eq!(
            shared.unwrap_err(),
            "kind(Shared) is not supported in csi migration"
        );

        // Azure file: the handle from the resource group, the account of the Secret, the share,
        // the PV and the namespace.
        let file = translate_pv(&pv(json!({"metadata": {"name": "file-pv", "annotations": {"kubernetes.io/azure-file-resource-group": "rg"}},
            "spec": {"azureFile": {"secretName": "azure-storage-account-acct-secret", "shareName": "share"}, "claimRef": {"namespace": "team", "name": "c"}}}))).unwrap().unwrap();
        assert_eq!(
            csi_of(&file),
            json!({"driver": "file.csi.azure.com", "volumeHandle": "rg#acct#share#file-pv#team", "volumeAttributes": {"sharename": "share"}, "nodeStageSecretRef": {"name": "azure-storage-account-acct-secret", "namespace": "team"}})
        );
        let nowhere = translate_pv(&pv(json!({"metadata": {"name": "p"}, "spec": {"azureFile": {"secretName": "s", "shareName": "x"}}}))).unwrap();
        assert!(nowhere
            .unwrap_err()
            .contains("could not find a secret namespace"));

        // Cinder and vSphere: their topology keys.
        let cinder = translate_pv(&pv(json!({"metadata": {"name": "p", "labels": {ZONE: "nova"}}, "spec": {"cinder": {"volumeID": "uuid"}}}))).unwrap().unwrap();
        assert_eq!(
            csi_of(&cinder),
            json!({"driver": "cinder.csi.openstack.org", "volumeHandle": "uuid", "volumeAttributes": {}})
        );
        assert_eq!(
            affinity(&cinder)["required"]["nodeSelectorTerms"][0]["matchExpressions"][0]["key"],
            "topology.cinder.csi.openstack.org/zone"
        );
        let vs = translate_pv(&pv(json!({"metadata": {"name": "p", "labels": {ZONE: "z1", REGION: "r1"}}, "spec": {"vsphereVolume": {"volumePath": "[ds] vols/v.vmdk", "storagePolicyName": "gold"}}}))).unwrap().unwrap();
        assert_eq!(
            csi_of(&vs),
            json!({"driver": "csi.vsphere.vmware.com", "volumeHandle": "[ds] vols/v.vmdk", "volumeAttributes": {"storagepolicyname": "gold"}})
        );
        let keys: Vec<String> = serde_json::from_value::<Vec<serde_json::Value>>(
            affinity(&vs)["required"]["nodeSelectorTerms"][0]["matchExpressions"].clone(),
        )
        .unwrap()
        .iter()
        .map(|r| r["key"].as_str().unwrap().to_string())
        .collect();
        assert_eq!(
            keys,
            [
                "topology.csi.vmware.com/zone",
                "topology.csi.vmware.com/region"
            ]
        );

        // Portworx: the secret of its annotations for every call.
        let px = translate_pv(&pv(json!({"metadata": {"name": "p", "annotations": {"openstorage.io/auth-secret-name": "px", "openstorage.io/auth-secret-namespace": "kube-system"}},
            "spec": {"portworxVolume": {"volumeID": "v1", "readOnly": true}}}))).unwrap().unwrap();
        let secret = json!({"name": "px", "namespace": "kube-system"});
        assert_eq!(
            csi_of(&px),
            json!({"driver": "pxd.portworx.com", "volumeHandle": "v1", "controllerPublishSecretRef": secret, "nodeStageSecretRef": secret, "nodePublishSecretRef": secret, "controllerExpandSecretRef": secret, "nodeExpandSecretRef": secret})
        );

        // Anything else is not translated.
        assert!(translate_pv(&pv(json!({"metadata": {"name": "p"}, "spec": {"csi": {"driver": "d", "volumeHandle": "h"}}}))).is_none());
    }

    #[test]
    fn inline_volumes_become_persistent_volumes_named_per_disk() {
        let inline = |v: serde_json::Value| {
            translate_inline(&serde_json::from_value(v).unwrap(), "team")
                .unwrap()
                .unwrap()
        };
        let gce =
            inline(json!({"name": "v", "gcePersistentDisk": {"pdName": "d", "readOnly": true}}));
        assert_eq!(
            gce.metadata.name.as_deref(),
            Some("pd.csi.storage.gke.io-d")
        );
        assert_eq!(
            csi_of(&gce)["volumeHandle"],
            "projects/UNSPECIFIED/zones/UNSPECIFIED/disks/d"
        );
        assert_eq!(
            gce.spec.as_ref().unwrap().access_modes,
            Some(vec!["ReadOnlyMany".to_string()])
        );
        let ebs = inline(json!({"name": "v", "awsElasticBlockStore": {"volumeID": "vol-1"}}));
        assert_eq!(ebs.metadata.name.as_deref(), Some("ebs.csi.aws.com-vol-1"));
        let file = inline(
            json!({"name": "v", "azureFile": {"secretName": "azure-storage-account-acct-secret", "shareName": "share"}}),
        );
        assert_eq!(csi_of(&file)["volumeHandle"], "#acct#share#v#team");
        assert_eq!(
            file.spec.as_ref().unwrap().access_modes,
            Some(vec!["ReadWriteMany".to_string()])
        );
        let disk = inline(
            json!({"name": "v", "azureDisk": {"diskName": "d", "diskURI": "/sub/d", "cachingMode": ""}}),
        );
        assert_eq!(
            csi_of(&disk)["volumeAttributes"],
            json!({"kind": "Managed"}),
            "an empty caching mode is left out inline"
        );
        let px =
            inline(json!({"name": "v", "portworxVolume": {"volumeID": "x", "readOnly": true}}));
        assert_eq!(
            (
                px.metadata.name.as_deref(),
                px.spec.as_ref().unwrap().access_modes.clone()
            ),
            (
                Some("pxd.portworx.com-x"),
                Some(vec!["ReadOnlyMany".to_string()])
            )
        );
        assert!(translate_inline(
            &serde_json::from_value(json!({"name": "v", "emptyDir": {}})).unwrap(),
            "team"
        )
        .is_none());
    }

    #[test]
    fn the_csinode_annotation_lists_every_migrated_plugin_sorted() {
        assert_eq!(
            migrated_plugins(),
            "kubernetes.io/aws-ebs,kubernetes.io/azure-disk,kubernetes.io/azure-file,kubernetes.io/cinder,kubernetes.io/gce-pd,kubernetes.io/portworx-volume,kubernetes.io/vsphere-volume"
        );
    }
}
