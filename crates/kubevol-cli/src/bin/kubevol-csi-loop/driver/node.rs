//! The Node service: staging formats the loop device (unless it holds a filesystem already) and
//! mounts it at the staging path; publishing bind-mounts the staging path, or the device node for
//! block access, at the target; stats, expansion and the node's topology.

use super::*;

#[tonic::async_trait]
impl Node for Svc {
    async fn node_stage_volume(
        &self,
        req: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let r = req.into_inner();
        check_id(&r.volume_id)?;
        if r.staging_target_path.is_empty() {
            return Err(invalid("staging_target_path"));
        }
        let Some(cap) = r.volume_capability.clone() else {
            return Err(invalid("volume_capability"));
        };
        let image = self.image(&r.volume_id);
        let id = r.volume_id.clone();
        let staging = PathBuf::from(&r.staging_target_path);
        self.log_request(
            "NodeStageVolume",
            &r.volume_id,
            &r.volume_context,
            &r.publish_context,
            &r.secrets,
            Some(&cap),
            false,
        );
        self.call(
            "NodeStageVolume",
            &r.volume_id,
            &r.staging_target_path,
            move || {
                existing_or_sized(&image, &id, &r.volume_context)?;
                let dev = device(&image, &r.publish_context)?;
                if is_block(&cap) {
                    // A block volume is used raw: staging only makes sure the device exists.
                    return Ok(NodeStageVolumeResponse {});
                }
                let (fs, flags) = mount_of(&cap);
                match sys::mounted_at(&staging).map_err(internal)? {
                    Some(src) if src == dev => return Ok(NodeStageVolumeResponse {}),
                    Some(src) => {
                        return Err(Status::already_exists(format!(
                            "{} has {src} mounted, not {dev}",
                            staging.display()
                        )))
                    }
                    None => {}
                }
                std::fs::create_dir_all(&staging)
                    .map_err(|e| internal(format!("{}: {e}", staging.display())))?;
                sys::ensure_formatted(&dev, &fs).map_err(internal)?;
                sys::mount_fs(&dev, &staging, &fs, &flags, false).map_err(internal)?;
                Ok(NodeStageVolumeResponse {})
            },
        )
        .await
    }

    async fn node_unstage_volume(
        &self,
        req: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let r = req.into_inner();
        if r.volume_id.is_empty() {
            return Err(invalid("volume_id"));
        }
        if r.staging_target_path.is_empty() {
            return Err(invalid("staging_target_path"));
        }
        let staging = PathBuf::from(&r.staging_target_path);
        // Begun (a test reads the call in flight before its answer).
        self.log_request(
            "NodeUnstageVolume",
            &r.volume_id,
            &HashMap::new(),
            &HashMap::new(),
            &HashMap::new(),
            None,
            false,
        );
        // Without a controller that publishes, the node attached the device at stage.
        let image = (!self.controller_publish && check_id(&r.volume_id).is_ok())
            .then(|| self.image(&r.volume_id));
        self.call(
            "NodeUnstageVolume",
            &r.volume_id,
            &r.staging_target_path,
            move || {
                sys::unmount_all(&staging).map_err(internal)?;
                if let Some(image) = image.filter(|i| i.exists()) {
                    sys::detach_freed(&image).map_err(internal)?;
                }
                Ok(NodeUnstageVolumeResponse {})
            },
        )
        .await
    }

    async fn node_publish_volume(
        &self,
        req: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let r = req.into_inner();
        check_id(&r.volume_id)?;
        if r.target_path.is_empty() {
            return Err(invalid("target_path"));
        }
        let Some(cap) = r.volume_capability.clone() else {
            return Err(invalid("volume_capability"));
        };
        let image = self.image(&r.volume_id);
        let target = PathBuf::from(&r.target_path);
        let id = r.volume_id.clone();
        self.log_request(
            "NodePublishVolume",
            &r.volume_id,
            &r.volume_context,
            &r.publish_context,
            &r.secrets,
            Some(&cap),
            r.readonly,
        );
        self.call(
            "NodePublishVolume",
            &r.volume_id,
            &r.target_path,
            move || {
                let ephemeral =
                    r.volume_context.get(EPHEMERAL_KEY).map(String::as_str) == Some("true");
                if sys::mounted_at(&target).map_err(internal)?.is_some() {
                    return Ok(NodePublishVolumeResponse {});
                }
                if ephemeral {
                    let size = match r.volume_context.get(SIZE_KEY) {
                        Some(s) => parse_size(s).map_err(Status::invalid_argument)?,
                        None => DEFAULT_SIZE,
                    };
                    write_meta(&image, &Meta { ephemeral: true })?;
                    create_image(&image, size)?;
                    let dev = sys::attach(&image).map_err(internal)?;
                    let (fs, flags) = mount_of(&cap);
                    sys::ensure_formatted(&dev, &fs).map_err(internal)?;
                    std::fs::create_dir_all(&target)
                        .map_err(|e| internal(format!("{}: {e}", target.display())))?;
                    return sys::mount_fs(&dev, &target, &fs, &flags, r.readonly)
                        .map(|_| NodePublishVolumeResponse {})
                        .map_err(internal);
                }
                if is_block(&cap) {
                    existing_or_sized(&image, &id, &r.volume_context)?;
                    let dev = device(&image, &r.publish_context)?;
                    if !target.exists() {
                        std::fs::File::create(&target)
                            .map_err(|e| internal(format!("{}: {e}", target.display())))?;
                    }
                    return sys::bind(Path::new(&dev), &target, r.readonly)
                        .map(|_| NodePublishVolumeResponse {})
                        .map_err(internal);
                }
                if r.staging_target_path.is_empty() {
                    return Err(invalid("staging_target_path"));
                }
                let staging = PathBuf::from(&r.staging_target_path);
                if sys::mounted_at(&staging).map_err(internal)?.is_none() {
                    return Err(Status::failed_precondition(format!(
                        "volume {id} is not staged at {}",
                        staging.display()
                    )));
                }
                std::fs::create_dir_all(&target)
                    .map_err(|e| internal(format!("{}: {e}", target.display())))?;
                sys::bind(&staging, &target, r.readonly).map_err(internal)?;
                Ok(NodePublishVolumeResponse {})
            },
        )
        .await
    }

    async fn node_unpublish_volume(
        &self,
        req: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let r = req.into_inner();
        if r.volume_id.is_empty() {
            return Err(invalid("volume_id"));
        }
        if r.target_path.is_empty() {
            return Err(invalid("target_path"));
        }
        let target = PathBuf::from(&r.target_path);
        let image = check_id(&r.volume_id)
            .ok()
            .map(|_| self.image(&r.volume_id));
        self.call(
            "NodeUnpublishVolume",
            &r.volume_id,
            &r.target_path,
            move || {
                sys::unmount_all(&target).map_err(internal)?;
                sys::remove_target(&target).map_err(internal)?;
                if let Some(image) = image.filter(|i| read_meta(i).ephemeral) {
                    sys::detach(&image).map_err(internal)?;
                    match std::fs::remove_file(&image) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => return Err(internal(format!("remove {}: {e}", image.display()))),
                    }
                    let _ = std::fs::remove_file(meta_path(&image));
                }
                Ok(NodeUnpublishVolumeResponse {})
            },
        )
        .await
    }

    async fn node_get_volume_stats(
        &self,
        req: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let r = req.into_inner();
        check_id(&r.volume_id)?;
        if r.volume_path.is_empty() {
            return Err(invalid("volume_path"));
        }
        let path = PathBuf::from(&r.volume_path);
        let image = self.image(&r.volume_id);
        self.call(
            "NodeGetVolumeStats",
            &r.volume_id,
            &r.volume_path,
            move || {
                let meta = std::fs::metadata(&path)
                    .map_err(|_| Status::not_found(format!("{} does not exist", path.display())))?;
                if !meta.is_dir() {
                    let dev = sys::loops_of(&image).map_err(internal)?.into_iter().next();
                    let total = match dev {
                        Some(d) => sys::device_size(&d).map_err(internal)?,
                        None => std::fs::metadata(&image)
                            .map(|m| m.len() as i64)
                            .unwrap_or(0),
                    };
                    return Ok(NodeGetVolumeStatsResponse {
                        usage: vec![VolumeUsage {
                            available: 0,
                            total,
                            used: 0,
                            unit: volume_usage::Unit::Bytes as i32,
                        }],
                        volume_condition: None,
                    });
                }
                let [total, avail, used, itotal, ifree, iused] =
                    sys::usage(&path).map_err(internal)?;
                Ok(NodeGetVolumeStatsResponse {
                    usage: vec![
                        VolumeUsage {
                            available: avail,
                            total,
                            used,
                            unit: volume_usage::Unit::Bytes as i32,
                        },
                        VolumeUsage {
                            available: ifree,
                            total: itotal,
                            used: iused,
                            unit: volume_usage::Unit::Inodes as i32,
                        },
                    ],
                    volume_condition: None,
                })
            },
        )
        .await
    }

    async fn node_get_volume_health(
        &self,
        req: Request<NodeGetVolumeHealthRequest>,
    ) -> Result<Response<NodeGetVolumeHealthResponse>, Status> {
        let r = req.into_inner();
        check_id(&r.volume_id)?;
        let image = self.image(&r.volume_id);
        let id = r.volume_id.clone();
        self.call(
            "NodeGetVolumeHealth",
            &r.volume_id,
            &r.volume_publish_path,
            move || {
                Ok(NodeGetVolumeHealthResponse {
                    volume_health: Some(VolumeHealth {
                        volume_id: id,
                        health_statuses: volume_health(&image),
                    }),
                })
            },
        )
        .await
    }

    async fn node_get_storage_health(
        &self,
        _: Request<NodeGetStorageHealthRequest>,
    ) -> Result<Response<NodeGetStorageHealthResponse>, Status> {
        let dir = self.data_dir.join("volumes");
        self.call("NodeGetStorageHealth", "", "", move || {
            Ok(NodeGetStorageHealthResponse {
                backend_health: storage_health(&dir),
            })
        })
        .await
    }

    async fn node_expand_volume(
        &self,
        req: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        let r = req.into_inner();
        check_id(&r.volume_id)?;
        if r.volume_path.is_empty() {
            return Err(invalid("volume_path"));
        }
        let image = self.image(&r.volume_id);
        let id = r.volume_id.clone();
        let path = PathBuf::from(&r.volume_path);
        let want = r.capacity_range.map_or(0, |c| c.required_bytes);
        let block = r.volume_capability.as_ref().is_some_and(is_block);
        self.call(
            "NodeExpandVolume",
            &r.volume_id,
            &r.volume_path,
            move || {
                // Standalone nodes have no controller-side resizer: the node grows the file too.
                grow_image(&image, &id, want)?;
                let dev = sys::loops_of(&image)
                    .map_err(internal)?
                    .into_iter()
                    .next()
                    .ok_or_else(|| {
                        Status::failed_precondition(format!("volume {id} is not attached"))
                    })?;
                if !block {
                    sys::grow_fs(&dev, &path).map_err(internal)?;
                }
                Ok(NodeExpandVolumeResponse {
                    capacity_bytes: sys::device_size(&dev).map_err(internal)?,
                })
            },
        )
        .await
    }

    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        use node_service_capability::{rpc, Rpc, Type};
        let cap = |t: rpc::Type| NodeServiceCapability {
            r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })),
        };
        self.call("NodeGetCapabilities", "", "", move || {
            Ok(NodeGetCapabilitiesResponse {
                capabilities: vec![
                    cap(rpc::Type::StageUnstageVolume),
                    cap(rpc::Type::GetVolumeStats),
                    cap(rpc::Type::ExpandVolume),
                    cap(rpc::Type::GetVolumeHealth),
                    cap(rpc::Type::GetStorageHealth),
                ],
            })
        })
        .await
    }

    async fn node_get_info(
        &self,
        _: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        let node_id = self.node_id.clone();
        let max_file = self.max_volumes_file.clone();
        self.call("NodeGetInfo", "", "", move || {
            // A loop device exists on its node only: the volume's topology is the node.
            let segments = [(TOPOLOGY_KEY.to_string(), node_id.clone())].into();
            let max_volumes_per_node = match &max_file {
                None => 0,
                Some(f) => match std::fs::read_to_string(f) {
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
                    Err(e) => return Err(Status::internal(format!("{}: {e}", f.display()))),
                    Ok(text) if text.trim().is_empty() => 0,
                    Ok(text) => text.trim().parse::<i64>().map_err(|e| {
                        Status::internal(format!("{}: not a number of volumes: {e}", f.display()))
                    })?,
                },
            };
            Ok(NodeGetInfoResponse {
                node_id,
                max_volumes_per_node,
                accessible_topology: Some(Topology { segments }),
            })
        })
        .await
    }
}

/// What is wrong with the volume whose backing file is `image`: nothing, or the file is gone
/// (`Inaccessible`: a loop device that still holds it serves the data until it is detached, but
/// the volume cannot be attached again).
fn volume_health(image: &Path) -> Vec<volume_health::VolumeHealthEntry> {
    use volume_health::VolumeHealthEntry;
    match std::fs::symlink_metadata(image) {
        Ok(m) if m.is_file() => Vec::new(),
        Ok(_) => vec![VolumeHealthEntry {
            status: VolumeHealthErrorType::Inaccessible as i32,
            reason: "BackingFileInvalid".into(),
            message: format!("{} is not a regular file", image.display()),
        }],
        Err(e) => vec![VolumeHealthEntry {
            status: VolumeHealthErrorType::Inaccessible as i32,
            reason: "BackingFileMissing".into(),
            message: format!("{}: {e}", image.display()),
        }],
    }
}

/// The free share of the backing filesystem under which the storage counts as degraded.
const LOW_SPACE_PERCENT: u64 = 5;

/// What is wrong with the storage under `dir` (where the backing files live): nothing, the
/// directory is gone (`StorageUnreachable`), or its filesystem has less than 5% free
/// (`StorageDegraded`).
fn storage_health(dir: &Path) -> Vec<node_get_storage_health_response::StorageBackendHealth> {
    use node_get_storage_health_response::StorageBackendHealth;
    let entry = |status: StorageHealthErrorType, reason: &str, message: String| {
        vec![StorageBackendHealth {
            status: status as i32,
            reason: reason.into(),
            message,
            volume_capability: None,
        }]
    };
    match rustix::fs::statvfs(dir) {
        Err(e) => entry(
            StorageHealthErrorType::StorageUnreachable,
            "BackingDirectoryUnreachable",
            format!("{}: {e}", dir.display()),
        ),
        Ok(s) if s.f_blocks > 0 && s.f_bavail * 100 < s.f_blocks * LOW_SPACE_PERCENT => entry(
            StorageHealthErrorType::StorageDegraded,
            "LowSpace",
            format!(
                "the filesystem of {} has {} of {} blocks free",
                dir.display(),
                s.f_bavail,
                s.f_blocks
            ),
        ),
        Ok(_) => Vec::new(),
    }
}
