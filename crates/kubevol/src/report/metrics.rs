//! Prometheus metrics with the kubelet's names and buckets.
//!
//! `volume_manager_total_volumes{plugin_name,state}` is computed from both states of world at
//! scrape time; `storage_operation_duration_seconds` is observed by the executor for every
//! operation, and `volume_operation_total_seconds` (`overall_volume_mount`) at a volume's first
//! set-up (both Beta in Kubernetes 1.37, their plugin label `kubernetes.io/csi:<driver>` for a
//! CSI volume); `kubevol_pod_volumes_ready_duration_seconds` measures from the moment a pod entered
//! the desired state until all its volumes were mounted.

use std::collections::BTreeMap;
use std::sync::{LazyLock, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// The kubelet's buckets for `storage_operation_duration_seconds`.
pub const OPERATION_BUCKETS: [f64; 13] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 25.0, 50.0, 120.0, 300.0, 600.0,
];

/// Buckets for pod volume-ready latency (finer at the low end, where kubevol lives).
pub const READY_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Labels of `volume_manager_total_volumes`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TotalVolumesLabels {
    /// The plugin.
    pub plugin_name: String,
    /// `desired_state_of_world` or `actual_state_of_world`.
    pub state: String,
}

/// Labels of `storage_operation_duration_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabels {
    /// The plugin.
    pub volume_plugin: String,
    /// The kubelet's operation name (`volume_mount`, `volume_unmount`, ...).
    pub operation_name: &'static str,
    /// `success` or `fail-unknown`.
    pub status: &'static str,
    /// Always `false`: kubevol does not migrate in-tree plugins.
    pub migrated: &'static str,
}

/// Labels of `volume_operation_total_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndToEndLabels {
    /// The plugin (`kubernetes.io/csi:<driver>` for CSI volumes).
    pub plugin_name: String,
    /// `overall_volume_mount`.
    pub operation_name: &'static str,
}

/// Labels of `csi_operations_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CsiOperationLabels {
    /// The CSI driver.
    pub driver_name: String,
    /// The full gRPC method, e.g. `/csi.v1.Node/NodePublishVolume`.
    pub method_name: String,
    /// The gRPC status code's name, e.g. `OK`, `DeadlineExceeded`.
    pub grpc_status_code: String,
    /// Always `false`: kubevol does not migrate in-tree plugins.
    pub migrated: String,
}

/// Labels of the `kubelet_volume_stats_*` gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VolumeStatsLabels {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim.
    pub persistentvolumeclaim: String,
}

/// One volume's usage, as `kubelet_volume_stats_*` reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VolumeUsage {
    /// Capacity in bytes.
    pub capacity_bytes: i64,
    /// Available bytes.
    pub available_bytes: i64,
    /// Used bytes.
    pub used_bytes: i64,
    /// Inodes.
    pub inodes: i64,
    /// Free inodes.
    pub inodes_free: i64,
    /// Used inodes.
    pub inodes_used: i64,
    /// Whether the driver reports the volume abnormal.
    pub abnormal: bool,
}

/// Log lines lost because they could not be queued or written (a closed pipe, a full disk, a
/// reader that stalls): the process logs through one writer, so the count is process-wide.
static LOG_LINES_DROPPED: LazyLock<Counter> = LazyLock::new(Counter::default);

/// Counts log lines the log writer had to drop.
pub fn count_dropped_log_lines(n: u64) {
    LOG_LINES_DROPPED.inc_by(n);
}

/// How many log lines have been dropped so far.
pub fn dropped_log_lines() -> u64 {
    LOG_LINES_DROPPED.get()
}

fn operation_histogram() -> Histogram {
    Histogram::new(OPERATION_BUCKETS)
}

/// Labels of the `volume_manager_selinux_*` gauges of one volume.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SelinuxVolumeLabels {
    /// The plugin (`kubernetes.io/csi:<driver>` for CSI volumes).
    pub volume_plugin: String,
    /// The volume's "highest" access mode (`RWX`, `ROX`, `RWO`, `RWOP`, `inline`).
    pub access_mode: String,
}

/// Labels of the `volume_manager_selinux_*` gauges of a pod.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SelinuxPodLabels {
    /// The volume's "highest" access mode.
    pub access_mode: String,
}

/// Labels of `kubelet_podcertificate_states`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PodCertificateLabels {
    /// The source's signer.
    pub signer_name: String,
    /// `not_yet_issued`, `fresh`, `overdue_for_refresh`, `expired`, `denied` or `failed`.
    pub state: String,
}

/// Labels of `csi_node_storage_health_status`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StorageHealthLabels {
    /// The CSI driver.
    pub driver_name: String,
    /// `StorageUnreachable` or `StorageDegraded`.
    pub status: String,
    /// The driver's reason.
    pub reason: String,
}

/// What the SELinux gauges count (each as the kubelet's metric of that name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SelinuxCount {
    /// A pod's containers that use one volume have different labels (the pod cannot start).
    PodMismatchError,
    /// The same, for a volume that is not mounted with its label (not an error).
    PodMismatchWarning,
    /// A pod needs a volume with another label than the pods that use it already.
    VolumeMismatchError,
    /// The same, for a volume that is not mounted with its label (not an error).
    VolumeMismatchWarning,
    /// A volume that will be mounted with its label.
    Admitted,
}

/// A series of `storage_operation_duration_seconds`: plugin, operation, success.
type OperationSeries = (String, &'static str, bool);

/// The metrics.
pub struct Metrics {
    registry: Registry,
    total_volumes: Family<TotalVolumesLabels, Gauge>,
    operation_duration: Family<OperationLabels, Histogram, fn() -> Histogram>,
    /// The histograms of `operation_duration` observed so far, by plugin, operation and
    /// outcome: a few, found without building (and hashing) a label set for every operation.
    operation_series: Mutex<Vec<(OperationSeries, Histogram)>>,
    pod_ready: Histogram,
    end_to_end: Family<EndToEndLabels, Histogram, fn() -> Histogram>,
    csi_operations: Family<CsiOperationLabels, Histogram, fn() -> Histogram>,
    volume_stats: [Family<VolumeStatsLabels, Gauge>; 7],
    orphans_cleaned: Gauge,
    orphan_errors: Gauge,
    reconstruction_problems: Gauge,
    selinux_pod: [Family<SelinuxPodLabels, Gauge>; 2],
    selinux_volume: [Family<SelinuxVolumeLabels, Gauge>; 3],
    pod_certificates: Family<PodCertificateLabels, Gauge>,
    storage_health: Family<StorageHealthLabels, Gauge>,
    render: Mutex<()>,
}

/// The `kubelet_volume_stats_*` gauges, in [`VolumeUsage`]'s field order.
const VOLUME_STATS: [(&str, &str); 7] = [
    (
        "kubelet_volume_stats_capacity_bytes",
        "Capacity in bytes of the volume",
    ),
    (
        "kubelet_volume_stats_available_bytes",
        "Number of available bytes in the volume",
    ),
    (
        "kubelet_volume_stats_used_bytes",
        "Number of used bytes in the volume",
    ),
    (
        "kubelet_volume_stats_inodes",
        "Maximum number of inodes in the volume",
    ),
    (
        "kubelet_volume_stats_inodes_free",
        "Number of free inodes in the volume",
    ),
    (
        "kubelet_volume_stats_inodes_used",
        "Number of used inodes in the volume",
    ),
    (
        "kubelet_volume_stats_health_status_abnormal",
        "Abnormal volume health status: 1 abnormal, 0 normal",
    ),
];

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let total_volumes = Family::<TotalVolumesLabels, Gauge>::default();
        let operation_duration =
            Family::<OperationLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                operation_histogram,
            );
        let pod_ready = Histogram::new(READY_BUCKETS);
        registry.register(
            "volume_manager_total_volumes",
            "Number of volumes in Volume Manager",
            total_volumes.clone(),
        );
        registry.register(
            "storage_operation_duration_seconds",
            "Storage operation duration",
            operation_duration.clone(),
        );
        let end_to_end =
            Family::<EndToEndLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                operation_histogram,
            );
        registry.register(
            "volume_operation_total_seconds",
            "Storage operation end to end duration in seconds",
            end_to_end.clone(),
        );
        registry.register(
            "kubevol_pod_volumes_ready_duration_seconds",
            "Time from a pod entering the desired state until all its volumes are mounted",
            pod_ready.clone(),
        );
        let csi_operations =
            Family::<CsiOperationLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                operation_histogram,
            );
        registry.register(
            "csi_operations_seconds",
            "Container Storage Interface operation duration with gRPC error code status total",
            csi_operations.clone(),
        );
        let volume_stats: [Family<VolumeStatsLabels, Gauge>; 7] = Default::default();
        for ((name, help), family) in VOLUME_STATS.iter().zip(&volume_stats) {
            registry.register(*name, *help, family.clone());
        }
        let orphans_cleaned = Gauge::default();
        let orphan_errors = Gauge::default();
        let reconstruction_problems = Gauge::default();
        registry.register(
            "kubelet_orphan_pod_cleaned_volumes",
            "The total number of orphaned Pods whose volumes were cleaned in the last periodic sweep",
            orphans_cleaned.clone(),
        );
        registry.register(
            "kubelet_orphan_pod_cleaned_volumes_errors",
            "The number of orphaned Pods whose volumes failed to be cleaned in the last periodic sweep",
            orphan_errors.clone(),
        );
        registry.register(
            "kubevol_reconstruction_problems",
            "Unreadable records and unaccounted volume directories found at start",
            reconstruction_problems.clone(),
        );
        registry.register(
            "kubevol_log_lines_dropped",
            "Log lines dropped because they could not be written (closed or full log) or queued",
            LOG_LINES_DROPPED.clone(),
        );
        let selinux_pod: [Family<SelinuxPodLabels, Gauge>; 2] = Default::default();
        let selinux_volume: [Family<SelinuxVolumeLabels, Gauge>; 3] = Default::default();
        for (name, help, family) in [
            ("volume_manager_selinux_pod_context_mismatch_errors_total", "Number of errors when a Pod defines different SELinux contexts for its containers that use the same volume", &selinux_pod[0]),
            ("volume_manager_selinux_pod_context_mismatch_warnings_total", "Number of Pods that define different SELinux contexts for their containers that use the same volume, for volumes not mounted with a context", &selinux_pod[1]),
        ] {
            registry.register(name, help, family.clone());
        }
        for (name, help, family) in [
            ("volume_manager_selinux_volume_context_mismatch_errors_total", "Number of errors when a Pod uses a volume that is already mounted with a different SELinux context than the Pod needs", &selinux_volume[0]),
            ("volume_manager_selinux_volume_context_mismatch_warnings_total", "Number of Pods that use a volume with a different SELinux context than other Pods, for volumes not mounted with a context", &selinux_volume[1]),
            ("volume_manager_selinux_volumes_admitted_total", "Number of volumes whose SELinux context was fine and will be mounted with mount -o context option", &selinux_volume[2]),
        ] {
            registry.register(name, help, family.clone());
        }
        let pod_certificates = Family::<PodCertificateLabels, Gauge>::default();
        registry.register(
            "kubelet_podcertificate_states",
            "Gauge vector reporting the number of pod certificate projected volume sources, faceted by signer_name and state.",
            pod_certificates.clone(),
        );
        let storage_health = Family::<StorageHealthLabels, Gauge>::default();
        registry.register(
            "csi_node_storage_health_status",
            "CSI node storage backend health conditions currently reported (1 = present).",
            storage_health.clone(),
        );
        Metrics {
            registry,
            pod_certificates,
            storage_health,
            selinux_pod,
            selinux_volume,
            orphans_cleaned,
            orphan_errors,
            reconstruction_problems,
            total_volumes,
            operation_duration,
            operation_series: Mutex::default(),
            pod_ready,
            end_to_end,
            csi_operations,
            volume_stats,
            render: Mutex::new(()),
        }
    }
}

impl Metrics {
    /// Counts one SELinux event of a volume of `plugin` with `access_mode`.
    pub fn count_selinux(&self, what: SelinuxCount, plugin: &str, access_mode: &str) {
        let pod = |i: usize| {
            self.selinux_pod[i]
                .get_or_create(&SelinuxPodLabels {
                    access_mode: access_mode.to_string(),
                })
                .inc();
        };
        let volume = |i: usize| {
            self.selinux_volume[i]
                .get_or_create(&SelinuxVolumeLabels {
                    volume_plugin: plugin.to_string(),
                    access_mode: access_mode.to_string(),
                })
                .inc();
        };
        match what {
            SelinuxCount::PodMismatchError => pod(0),
            SelinuxCount::PodMismatchWarning => pod(1),
            SelinuxCount::VolumeMismatchError => volume(0),
            SelinuxCount::VolumeMismatchWarning => volume(1),
            SelinuxCount::Admitted => volume(2),
        }
    }

    /// Records the outcome of one orphan sweep.
    pub fn set_orphan_sweep(&self, cleaned: usize, errors: usize) {
        self.orphans_cleaned.set(cleaned as i64);
        self.orphan_errors.set(errors as i64);
    }

    /// Records how many problems reconstruction reported.
    pub fn set_reconstruction_problems(&self, n: usize) {
        self.reconstruction_problems.set(n as i64);
    }

    /// Records one finished operation.
    pub fn observe_operation(
        &self,
        plugin: &str,
        operation: &'static str,
        success: bool,
        seconds: f64,
    ) {
        let mut series = crate::sync::lock(&self.operation_series);
        let at = series
            .iter()
            .position(|((p, o, s), _)| *o == operation && *s == success && p == plugin);
        let at = at.unwrap_or_else(|| {
            let histogram = self
                .operation_duration
                .get_or_create(&OperationLabels {
                    volume_plugin: plugin.to_string(),
                    operation_name: operation,
                    status: if success { "success" } else { "fail-unknown" },
                    migrated: "false",
                })
                .clone();
            series.push(((plugin.to_string(), operation, success), histogram));
            series.len() - 1
        });
        series[at].1.observe(seconds);
    }

    /// Records an operation's end-to-end time (`overall_volume_mount`: from the pod volume's
    /// entry in the desired state to its first successful set-up, as the kubelet measures it).
    pub fn observe_end_to_end(&self, plugin: &str, operation: &'static str, seconds: f64) {
        self.end_to_end
            .get_or_create(&EndToEndLabels {
                plugin_name: plugin.to_string(),
                operation_name: operation,
            })
            .observe(seconds);
    }

    /// Records how long a pod waited for its volumes.
    pub fn observe_pod_ready(&self, seconds: f64) {
        self.pod_ready.observe(seconds);
    }

    /// Records one CSI call.
    pub fn observe_csi(&self, driver: &str, method: &str, code: &str, seconds: f64) {
        self.csi_operations
            .get_or_create(&CsiOperationLabels {
                driver_name: driver.to_string(),
                method_name: method.to_string(),
                grpc_status_code: code.to_string(),
                migrated: "false".to_string(),
            })
            .observe(seconds);
    }

    /// Replaces every `kubelet_volume_stats_*` series with `stats` (claims not listed vanish).
    pub fn set_volume_stats(&self, stats: &BTreeMap<(String, String), VolumeUsage>) {
        let _one_at_a_time = crate::sync::lock(&self.render);
        for f in &self.volume_stats {
            f.clear();
        }
        for ((namespace, claim), u) in stats {
            let labels = VolumeStatsLabels {
                namespace: namespace.clone(),
                persistentvolumeclaim: claim.clone(),
            };
            let values = [
                u.capacity_bytes,
                u.available_bytes,
                u.used_bytes,
                u.inodes,
                u.inodes_free,
                u.inodes_used,
                i64::from(u.abnormal),
            ];
            for (f, v) in self.volume_stats.iter().zip(values) {
                f.get_or_create(&labels).set(v);
            }
        }
    }

    /// Sets `csi_node_storage_health_status` to the conditions each driver reports now (1 each,
    /// every other series gone).
    pub(crate) fn set_storage_health(
        &self,
        by_driver: &BTreeMap<String, Vec<crate::report::health::Condition>>,
    ) {
        let _one_at_a_time = crate::sync::lock(&self.render);
        self.storage_health.clear();
        for (driver, conditions) in by_driver {
            for c in conditions {
                self.storage_health
                    .get_or_create(&StorageHealthLabels {
                        driver_name: driver.clone(),
                        status: c.status.clone(),
                        reason: c.reason.clone(),
                    })
                    .set(1);
            }
        }
    }

    /// Sets `pod_certificate_states` to `states`: the count of pod certificates by (signer,
    /// state), every other series gone.
    pub(crate) fn set_pod_certificates(
        &self,
        states: impl IntoIterator<Item = ((String, String), i64)>,
    ) {
        let _one_at_a_time = crate::sync::lock(&self.render);
        self.pod_certificates.clear();
        for ((signer_name, state), n) in states {
            self.pod_certificates
                .get_or_create(&PodCertificateLabels { signer_name, state })
                .set(n);
        }
    }

    /// Renders the Prometheus text format, with the volume totals given per (plugin, state).
    pub fn render(&self, totals: &BTreeMap<(String, &'static str), i64>) -> String {
        let _one_at_a_time = crate::sync::lock(&self.render);
        self.total_volumes.clear();
        for ((plugin, state), n) in totals {
            self.total_volumes
                .get_or_create(&TotalVolumesLabels {
                    plugin_name: plugin.clone(),
                    state: state.to_string(),
                })
                .set(*n);
        }
        let mut out = String::new();
        // Encoding into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_kubelet_names_and_labels() {
        let m = Metrics::default();
        m.observe_operation("kubernetes.io/empty-dir", "volume_mount", true, 0.01);
        let mut totals = BTreeMap::new();
        totals.insert(
            (
                "kubernetes.io/empty-dir".to_string(),
                "desired_state_of_world",
            ),
            3,
        );
        let text = m.render(&totals);
        assert!(text.contains(r#"volume_manager_total_volumes{plugin_name="kubernetes.io/empty-dir",state="desired_state_of_world"} 3"#), "{text}");
        assert!(text.contains(r#"storage_operation_duration_seconds_bucket{le="0.1",volume_plugin="kubernetes.io/empty-dir",operation_name="volume_mount",status="success",migrated="false"} 1"#), "{text}");
        assert!(
            text.contains("kubevol_pod_volumes_ready_duration_seconds"),
            "{text}"
        );
    }
}
