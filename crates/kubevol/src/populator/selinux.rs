//! The SELinux label of a pod's volume, decided as the kubelet decides it, and the conflicts
//! between pods that share a volume.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kubevol_core::state::VolumeSpec;
use kubevol_core::PodRef;

use super::Populator;
use crate::events::reason;

impl Populator {
    /// The volume's SELinux label and whether it is mounted with it, decided as the kubelet
    /// decides (see [`kubevol_core::selinux`]), or why the pod cannot use the volume: its
    /// containers disagree on the label, or other pods use the volume with another one — for a
    /// volume mounted with its label; for others these are counted as warnings only.
    pub(super) fn selinux(
        &self,
        pod: &Pod,
        pref: &PodRef,
        volume: &str,
        spec: Arc<VolumeSpec>,
        plugin: &dyn crate::plugins::VolumePlugin,
        name: &kubevol_core::UniqueVolumeName,
    ) -> Result<Arc<VolumeSpec>, String> {
        use crate::report::metrics::SelinuxCount;
        use kubevol_core::selinux as se;
        let pv_spec = spec
            .persistent_volume
            .as_ref()
            .and_then(|pv| pv.spec.as_ref());
        let modes = pv_spec.and_then(|s| s.access_modes.as_deref());
        let mode_ok = se::mode_allows_mount(modes, self.host.selinux_mount_all);
        let count = |what| {
            // The kubelet's label: the plugin, and for CSI its driver.
            let plugin_name = match pv_spec.and_then(|s| s.csi.as_ref()) {
                Some(csi) => format!("{}:{}", plugin.name(), csi.driver),
                None => plugin.name().to_string(),
            };
            let access = se::metric_access_mode(modes);
            self.host.metrics.count_selinux(what, &plugin_name, access);
        };
        let Some(context) = &self.host.selinux_context else {
            // Without SELinux nothing is labelled: a pod is told only where it would have been.
            let would_mount = mode_ok && plugin.supports_selinux_mount(&self.host, &spec);
            let asked = || {
                se::volume_label(pod, volume, se::DEFAULT_FILE_CONTEXT)
                    .map_or(true, |l| l.is_some())
            };
            if would_mount && asked() {
                self.events.record(
                    pref,
                    true,
                    reason::SELINUX_UNAVAILABLE,
                    format!(
                        "volume {volume:?} of pod {pref}: the pod asks for an SELinux label, but this node has no SELinux (no selinuxfs at /sys/fs/selinux): it is mounted without -o context"
                    ),
                );
            }
            return Ok(spec);
        };
        let label = match se::volume_label(pod, volume, context) {
            Ok(label) => label,
            Err(labels) => {
                // An error for a volume of an access mode mounted with its label, whatever the
                // plugin (as the kubelet decides), a warning for the others.
                if !mode_ok {
                    count(SelinuxCount::PodMismatchWarning);
                    return Ok(spec);
                }
                count(SelinuxCount::PodMismatchError);
                return Err(format!(
                    "the containers that use the volume have different SELinux labels ({}): a volume of this access mode is labelled as a whole; give the containers that use it the same seLinuxOptions",
                    labels.join(", ")
                ));
            }
        };
        // The label the volume is mounted with, when it can be (the kubelet's: none for a
        // plugin that cannot, nor for a pod that asks the runtime to relabel recursively). A pod
        // without a label still conflicts with pods that have one.
        let supports = plugin.supports_selinux_mount(&self.host, &spec);
        let label = label.filter(|_| supports && !se::recursive_change(pod));
        if supports {
            let dsw = self.dsw.world().dsw();
            let existing = dsw.volume(name);
            let other = existing.and_then(|v| v.pods.values().find(|p| p.pod_ref.uid != pref.uid));
            if let Some(other) = other {
                if other.spec.selinux_label != label {
                    let show = |l: &Option<String>| format!("{:?}", l.as_deref().unwrap_or(""));
                    if mode_ok {
                        count(SelinuxCount::VolumeMismatchError);
                        return Err(format!(
                            "conflicting SELinux labels of volume {name}: {} (pod {}) and {} (this pod): a volume mounted with -o context has one label; give the pods the same seLinuxOptions",
                            show(&other.spec.selinux_label),
                            other.pod_ref,
                            show(&label)
                        ));
                    }
                    count(SelinuxCount::VolumeMismatchWarning);
                }
            } else if label.is_some() && existing.is_none() {
                count(SelinuxCount::Admitted);
            }
        }
        let Some(label) = label else {
            return Ok(spec);
        };
        Ok(Arc::new(VolumeSpec {
            selinux_label: Some(label),
            selinux_mount: mode_ok,
            ..(*spec).clone()
        }))
    }
}
