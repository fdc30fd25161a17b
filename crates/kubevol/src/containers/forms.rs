//! The forms container runtimes take a container's mounts in: the CRI's `Mount` and `Device`
//! (as the kubelet sends them to containerd and CRI-O, in the protobuf's JSON field names that
//! `crictl` reads), and a fragment of an OCI runtime-spec `config.json` (`mounts`, and
//! `linux.devices` with the cgroup rules that let the container use them), as a runtime such
//! as runc or crun takes it.

use serde_json::{json, Value};

use super::{ContainerMounts, Propagation};

impl Propagation {
    fn cri(self) -> &'static str {
        match self {
            Propagation::None => "PROPAGATION_PRIVATE",
            Propagation::HostToContainer => "PROPAGATION_HOST_TO_CONTAINER",
            Propagation::Bidirectional => "PROPAGATION_BIDIRECTIONAL",
        }
    }

    fn oci(self) -> &'static str {
        match self {
            Propagation::None => "rprivate",
            Propagation::HostToContainer => "rslave",
            Propagation::Bidirectional => "rshared",
        }
    }
}

impl ContainerMounts {
    /// The CRI form: `{"mounts": [Mount…], "devices": [Device…]}`, each as the kubelet fills it
    /// (an image volume as a `Mount` with `image` and `image_sub_path`).
    pub fn to_cri(&self) -> Value {
        let mounts: Vec<Value> = self
            .mounts
            .iter()
            .map(|m| {
                let mut v = json!({
                    "container_path": m.container_path,
                    "readonly": m.read_only,
                    "recursive_read_only": m.recursive_read_only,
                    "selinux_relabel": m.selinux_relabel,
                    "propagation": m.propagation.cri(),
                });
                match (&m.host_path, &m.image) {
                    (Some(host_path), _) => v["host_path"] = json!(host_path),
                    (None, Some(image)) => {
                        v["image"] = json!({ "image": image.reference });
                        if let Some(sub_path) = &m.sub_path {
                            v["image_sub_path"] = json!(sub_path);
                        }
                    }
                    (None, None) => {}
                }
                v
            })
            .collect();
        let devices: Vec<Value> = self
            .devices
            .iter()
            .map(|d| {
                json!({
                    "container_path": d.container_path,
                    "host_path": d.host_path,
                    "permissions": d.permissions,
                })
            })
            .collect();
        json!({ "mounts": mounts, "devices": devices })
    }

    /// The OCI form: `{"mounts": [...], "linux": {"devices": [...], "resources": {"devices":
    /// [...]}, "rootfsPropagation": ...}}`, to merge into a `config.json`
    /// (`rootfsPropagation` is `rslave` when a mount is `HostToContainer`, `rshared` when one
    /// is `Bidirectional`, as containerd sets it, and absent otherwise). Each mount is a recursive bind (`rbind`) with
    /// its propagation (`rprivate`, `rslave`, `rshared`) and `ro` or `rw`, plus `rro` when
    /// recursively read-only. Devices are looked up on the host for their numbers. An image
    /// volume has no OCI form (a runtime that pulls images mounts it): asking for one is an
    /// error naming it.
    pub fn to_oci(&self) -> Result<Value, String> {
        let mut mounts = Vec::with_capacity(self.mounts.len());
        for m in &self.mounts {
            let Some(source) = &m.host_path else {
                return Err(format!(
                    "volume {:?} is an image volume, which only a runtime that pulls images mounts: use the CRI form",
                    m.volume
                ));
            };
            let mut options = vec![
                "rbind",
                m.propagation.oci(),
                if m.read_only { "ro" } else { "rw" },
            ];
            if m.recursive_read_only {
                options.push("rro");
            }
            mounts.push(json!({
                "destination": m.container_path,
                "type": "bind",
                "source": source,
                "options": options,
            }));
        }
        let mut devices = Vec::with_capacity(self.devices.len());
        let mut allowed = Vec::with_capacity(self.devices.len());
        for d in &self.devices {
            let st = rustix::fs::stat(&d.host_path).map_err(|e| {
                format!(
                    "device {} of volume {:?}: {e}",
                    d.host_path.display(),
                    d.volume
                )
            })?;
            let kind = match rustix::fs::FileType::from_raw_mode(st.st_mode) {
                rustix::fs::FileType::BlockDevice => "b",
                rustix::fs::FileType::CharacterDevice => "c",
                _ => {
                    return Err(format!(
                        "{} of volume {:?} is not a device",
                        d.host_path.display(),
                        d.volume
                    ))
                }
            };
            let (major, minor) = (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev));
            devices.push(json!({
                "path": d.container_path,
                "type": kind,
                "major": major,
                "minor": minor,
                "fileMode": 0o660,
                "uid": 0,
                "gid": 0,
            }));
            allowed.push(json!({
                "allow": true,
                "type": kind,
                "major": major,
                "minor": minor,
                "access": "rwm",
            }));
        }
        let mut linux = json!({ "devices": devices, "resources": { "devices": allowed } });
        // A runtime makes the container's whole tree private first, unless told otherwise: a
        // propagating mount needs the tree to receive (as containerd sets it).
        let propagations = self.mounts.iter().map(|m| m.propagation);
        if let Some(most) = propagations.max_by_key(|p| *p as u8) {
            if most != Propagation::None {
                linux["rootfsPropagation"] = json!(most.oci());
            }
        }
        Ok(json!({ "mounts": mounts, "linux": linux }))
    }
}
