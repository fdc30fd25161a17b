//! The node-wide steps of a volume: attach, mount device (stage) and their inverses.

use kubevol_core::names::SharedStr;
use std::sync::Arc;

use kubevol_core::reconcile::Operation;
use kubevol_core::state::DeviceMountState;
use kubevol_core::PodRef;
use tracing::{info, instrument, warn};

use super::settle_device_record;
use super::{effected, intend, Operations};
use crate::error::ErrorClass;
use crate::events::reason;
use crate::plugins::DeviceRequest;
use crate::record;

/// Attach, mount device, unmount device or detach: one volume, for the whole node.
#[instrument(skip(ops), fields(operation = op.metric_name()))]
pub(super) async fn device_operation(
    ops: &Arc<Operations>,
    op: &Operation,
) -> (SharedStr, Result<(), String>) {
    let volume = &op.key().volume;
    let wanted = ops.wanted_device(volume);
    let (traits, spec, publish_context) = {
        let asw = ops.world().asw();
        let have = asw.volume(volume);
        let publish_context = have.map(|v| v.publish_context.clone()).unwrap_or_default();
        match (wanted, have) {
            // Set-up steps take the spec pods want now; teardown steps the one it was set up
            // with (the pods are gone).
            (Some((t, s)), _) if !op.is_teardown() => (t, s, publish_context),
            (wanted, Some(v)) => match (v.spec.clone(), wanted) {
                (Some(s), _) => (v.traits.clone(), s, publish_context),
                (None, Some((t, s))) => (t, s, publish_context),
                (None, None) => return (SharedStr::default(), Ok(())),
            },
            (Some((t, s)), None) => (t, s, publish_context),
            (None, None) => return (SharedStr::default(), Ok(())),
        }
    };
    let Some(plugin) = ops.plugins.by_name(&traits.plugin) else {
        return (
            traits.plugin.clone(),
            Err(format!(
                "volume {volume}: no plugin {} is registered",
                traits.plugin
            )),
        );
    };
    let req = DeviceRequest {
        volume: volume.clone(),
        spec: spec.clone(),
        publish_context: publish_context.clone(),
    };
    // The fail point and record name of the step, and the kubelet's name in messages.
    let (step, what) = match op {
        Operation::Attach { .. } => ("attach", "AttachVolume.Attach"),
        Operation::MountDevice { .. } => ("mount_device", "MountVolume.MountDevice"),
        Operation::UnmountDevice { .. } => ("unmount_device", "UnmountDevice"),
        _ => ("detach", "DetachVolume.Detach"),
    };
    let intent = {
        use record::DeviceStepState as S;
        let mut r = ops
            .world()
            .asw()
            .volume(volume)
            .and_then(record::DeviceRecord::of)
            .unwrap_or(record::DeviceRecord {
                version: record::VERSION,
                unique_name: volume.clone(),
                traits: record::TraitsRecord::of(&traits),
                attach: None,
                device_mount: None,
                device_mount_path: None,
                publish_context,
                expanded_size: None,
                spec: record::SpecRecord::of(&spec),
            });
        match op {
            Operation::Attach { .. } => r.attach = Some(S::Starting),
            Operation::MountDevice { .. } => r.device_mount = Some(S::Starting),
            Operation::UnmountDevice { .. } => r.device_mount = Some(S::Undoing),
            _ => r.attach = Some(S::Undoing),
        }
        r
    };
    let host = ops.host.clone();
    let outcome = match intend(ops, step, record::Change::Device(intent)).await {
        Err(e) => Err(e),
        Ok(()) => match op {
            Operation::Attach { .. } => match effected(step, plugin.attach(host, req).await) {
                Ok(ctx) => {
                    ops.asw
                        .write()
                        .mark_attached(volume, &traits, ctx, spec.clone());
                    Ok(())
                }
                Err(e) => {
                    if e.class() == ErrorClass::Uncertain {
                        ops.asw
                            .write()
                            .mark_attach_uncertain(volume, &traits, spec.clone());
                    }
                    Err(e)
                }
            },
            Operation::MountDevice { .. } => {
                match effected(step, plugin.mount_device(host, req).await) {
                    Ok(path) => {
                        ops.asw.write().mark_device_state(
                            volume,
                            &traits,
                            DeviceMountState::Mounted,
                            path,
                            spec.clone(),
                        );
                        Ok(())
                    }
                    Err(e) => {
                        if e.class() == ErrorClass::Uncertain {
                            ops.asw.write().mark_device_state(
                                volume,
                                &traits,
                                DeviceMountState::Uncertain,
                                None,
                                spec.clone(),
                            );
                        }
                        Err(e)
                    }
                }
            }
            Operation::UnmountDevice { .. } => {
                match effected(step, plugin.unmount_device(host, req).await) {
                    Ok(()) => {
                        ops.asw.write().mark_device_state(
                            volume,
                            &traits,
                            DeviceMountState::NotMounted,
                            None,
                            spec.clone(),
                        );
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }
            Operation::Detach { .. } => match effected(step, plugin.detach(host, req).await) {
                Ok(()) => {
                    ops.asw.write().mark_detached(volume);
                    Ok(())
                }
                Err(e) => Err(e),
            },
            Operation::MountVolume { .. } | Operation::UnmountVolume { .. } => {
                unreachable!("per-pod operations are not device operations")
            }
        },
    };
    settle_device_record(ops, volume);
    match outcome {
        Ok(()) => {
            info!(volume = %volume, "{what} succeeded");
            (traits.plugin, Ok(()))
        }
        Err(e) => {
            // Every pod waiting on the volume shows why, and the message names them with the
            // files they come from: a node-wide step has no single pod.
            let users: Vec<(PodRef, String)> = ops
                .world()
                .dsw()
                .volume(volume)
                .map(|v| {
                    v.pods
                        .values()
                        .map(|p| (p.pod_ref.clone(), p.outer_volume_name.to_string()))
                        .collect()
                })
                .unwrap_or_default();
            let pv = spec
                .persistent_volume
                .as_ref()
                .and_then(|p| p.metadata.name.as_deref())
                .map(|n| format!("PersistentVolume {n}, "))
                .unwrap_or_default();
            let used_by = if users.is_empty() {
                "no pod uses it any more".to_string()
            } else {
                users
                    .iter()
                    .map(|(p, outer)| {
                        format!(
                            "volume {outer:?} of pod {p} ({})",
                            ops.store.pod_source(&p.uid)
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let message = format!("{what} failed for {pv}{volume} ({used_by}): {e}");
            let reason = if op.is_teardown() {
                reason::FAILED_UNMOUNT
            } else {
                reason::FAILED_MOUNT
            };
            for (p, _) in &users {
                ops.events.record(p, true, reason, message.clone());
            }
            if users.is_empty() {
                warn!("{message}");
            }
            (traits.plugin, Err(message))
        }
    }
}
