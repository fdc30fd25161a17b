//! The Controller service: a volume is created as a sparse image file (sized, or a copy of a
//! snapshot's or a volume's content), published by attaching it to a loop device, and grown by
//! growing the file.

use super::*;

#[tonic::async_trait]
impl Controller for Svc {
    async fn create_volume(
        &self,
        req: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let r = req.into_inner();
        if r.name.is_empty() {
            return Err(invalid("name"));
        }
        if r.volume_capabilities.is_empty() {
            return Err(invalid("volume_capabilities"));
        }
        let id = id_of(&r.name, "loop");
        let range = r.capacity_range.unwrap_or_default();
        let (want, limit) = (range.required_bytes, range.limit_bytes);
        if want < 0 || limit < 0 || (limit > 0 && want > limit) {
            return Err(Status::out_of_range(format!(
                "capacity range {want}..{limit} is not valid"
            )));
        }
        let size = if want > 0 {
            want
        } else if limit > 0 {
            limit.min(DEFAULT_SIZE)
        } else {
            DEFAULT_SIZE
        };
        // The parameters are logged as the request's context.
        self.log_request(
            "CreateVolume",
            &id,
            &r.parameters,
            &HashMap::new(),
            &r.secrets,
            r.volume_capabilities.first(),
            false,
        );
        let image = self.image(&id);
        // The content to start from: a snapshot's image, or another volume's.
        let source = match r
            .volume_content_source
            .as_ref()
            .and_then(|c| c.r#type.as_ref())
        {
            None => None,
            Some(volume_content_source::Type::Snapshot(s)) => {
                check_id(&s.snapshot_id)?;
                Some((
                    self.snapshot(&s.snapshot_id),
                    "snapshot",
                    s.snapshot_id.clone(),
                ))
            }
            Some(volume_content_source::Type::Volume(v)) => {
                check_id(&v.volume_id)?;
                Some((self.image(&v.volume_id), "volume", v.volume_id.clone()))
            }
        };
        let content_source = r.volume_content_source.clone();
        // A loop device exists on its node only: the volume is where it was asked to be (the
        // first preferred or requisite topology), which for this driver is its own node.
        let topology: Vec<Topology> = r
            .accessibility_requirements
            .and_then(|t| t.preferred.into_iter().chain(t.requisite).next())
            .into_iter()
            .collect();
        self.call("CreateVolume", &id.clone(), "", move || {
            let have = match &source {
                None => create_image(&image, size)?,
                Some((from, kind, from_id)) => copy_image(&image, from, size, kind, from_id)?,
            };
            if have < want || (limit > 0 && have > limit) {
                return Err(Status::already_exists(format!(
                    "volume {id} exists with {have} bytes, outside the requested range {want}..{limit}"
                )));
            }
            Ok(CreateVolumeResponse {
                volume: Some(Volume {
                    capacity_bytes: have,
                    volume_id: id,
                    volume_context: HashMap::new(),
                    content_source,
                    accessible_topology: topology,
                }),
            })
        })
        .await
    }

    async fn delete_volume(
        &self,
        req: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let r = req.into_inner();
        if r.volume_id.is_empty() {
            return Err(invalid("volume_id"));
        }
        if check_id(&r.volume_id).is_err() {
            // A volume that cannot exist is deleted already.
            return Ok(Response::new(DeleteVolumeResponse {}));
        }
        self.log_request(
            "DeleteVolume",
            &r.volume_id,
            &HashMap::new(),
            &HashMap::new(),
            &r.secrets,
            None,
            false,
        );
        let image = self.image(&r.volume_id);
        let id = r.volume_id.clone();
        self.call("DeleteVolume", &r.volume_id, "", move || {
            if !image.exists() {
                return Ok(DeleteVolumeResponse {});
            }
            if !sys::loops_of(&image).map_err(internal)?.is_empty() {
                return Err(Status::failed_precondition(format!(
                    "volume {id} is attached to a loop device"
                )));
            }
            std::fs::remove_file(&image)
                .map_err(|e| internal(format!("remove {}: {e}", image.display())))?;
            let _ = std::fs::remove_file(meta_path(&image));
            Ok(DeleteVolumeResponse {})
        })
        .await
    }

    async fn create_snapshot(
        &self,
        req: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        let r = req.into_inner();
        if r.name.is_empty() {
            return Err(invalid("name"));
        }
        check_id(&r.source_volume_id)?;
        let id = id_of(&r.name, "snap");
        let snapshot = self.snapshot(&id);
        let image = self.image(&r.source_volume_id);
        let source_id = r.source_volume_id.clone();
        self.call("CreateSnapshot", &r.source_volume_id, "", move || {
            let source_of = snapshot.with_extension("source");
            if snapshot.exists() {
                // The same request again: the snapshot made before, if it is of that volume.
                let of = std::fs::read_to_string(&source_of).unwrap_or_default();
                if of != source_id {
                    return Err(Status::already_exists(format!(
                        "snapshot {id} exists, of volume {of:?}, not {source_id}"
                    )));
                }
            } else {
                if !image.exists() {
                    return Err(Status::not_found(format!(
                        "volume {source_id} does not exist"
                    )));
                }
                if let Some(dir) = snapshot.parent() {
                    std::fs::create_dir_all(dir)
                        .map_err(|e| internal(format!("{}: {e}", dir.display())))?;
                }
                std::fs::write(&source_of, &source_id)
                    .map_err(|e| internal(format!("{}: {e}", source_of.display())))?;
                copy_image(&snapshot, &image, 0, "volume", &source_id)?;
            }
            let size_bytes = std::fs::metadata(&snapshot)
                .map_err(|e| internal(format!("{}: {e}", snapshot.display())))?
                .len() as i64;
            Ok(CreateSnapshotResponse {
                snapshot: Some(Snapshot {
                    size_bytes,
                    snapshot_id: id,
                    source_volume_id: source_id,
                    ready_to_use: true,
                }),
            })
        })
        .await
    }

    async fn delete_snapshot(
        &self,
        req: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        let r = req.into_inner();
        if r.snapshot_id.is_empty() {
            return Err(invalid("snapshot_id"));
        }
        if check_id(&r.snapshot_id).is_err() {
            // A snapshot that cannot exist is deleted already.
            return Ok(Response::new(DeleteSnapshotResponse {}));
        }
        let snapshot = self.snapshot(&r.snapshot_id);
        self.call("DeleteSnapshot", &r.snapshot_id, "", move || {
            for f in [snapshot.clone(), snapshot.with_extension("source")] {
                match std::fs::remove_file(&f) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(internal(format!("remove {}: {e}", f.display()))),
                }
            }
            Ok(DeleteSnapshotResponse {})
        })
        .await
    }

    async fn controller_publish_volume(
        &self,
        req: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        let r = req.into_inner();
        if !self.controller_publish {
            return Err(not_offered("ControllerPublishVolume"));
        }
        check_id(&r.volume_id)?;
        if r.node_id.is_empty() {
            return Err(invalid("node_id"));
        }
        if r.volume_capability.is_none() {
            return Err(invalid("volume_capability"));
        }
        if r.node_id != self.node_id {
            return Err(Status::not_found(format!(
                "node {:?} is not this driver's node {:?}",
                r.node_id, self.node_id
            )));
        }
        self.log_request(
            "ControllerPublishVolume",
            &r.volume_id,
            &r.volume_context,
            &HashMap::new(),
            &r.secrets,
            r.volume_capability.as_ref(),
            r.readonly,
        );
        let image = self.image(&r.volume_id);
        let id = r.volume_id.clone();
        self.call("ControllerPublishVolume", &r.volume_id, "", move || {
            existing_or_sized(&image, &id, &r.volume_context)?;
            let dev = sys::attach(&image).map_err(internal)?;
            Ok(ControllerPublishVolumeResponse {
                publish_context: HashMap::from([("devicePath".to_string(), dev)]),
            })
        })
        .await
    }

    async fn controller_unpublish_volume(
        &self,
        req: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        let r = req.into_inner();
        if !self.controller_publish {
            return Err(not_offered("ControllerUnpublishVolume"));
        }
        if r.volume_id.is_empty() {
            return Err(invalid("volume_id"));
        }
        if check_id(&r.volume_id).is_err() {
            return Ok(Response::new(ControllerUnpublishVolumeResponse {}));
        }
        let image = self.image(&r.volume_id);
        self.call("ControllerUnpublishVolume", &r.volume_id, "", move || {
            if image.exists() {
                sys::detach_freed(&image).map_err(internal)?;
            }
            Ok(ControllerUnpublishVolumeResponse {})
        })
        .await
    }

    async fn validate_volume_capabilities(
        &self,
        req: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        use volume_capability::access_mode::Mode;
        let r = req.into_inner();
        check_id(&r.volume_id)?;
        if r.volume_capabilities.is_empty() {
            return Err(invalid("volume_capabilities"));
        }
        if !self.image(&r.volume_id).exists() {
            return Err(Status::not_found(format!(
                "volume {} does not exist",
                r.volume_id
            )));
        }
        let node_local = r.volume_capabilities.iter().all(|c| {
            let mode = c.access_mode.as_ref().map_or(0, |m| m.mode);
            [
                Mode::SingleNodeWriter,
                Mode::SingleNodeReaderOnly,
                Mode::SingleNodeSingleWriter,
                Mode::SingleNodeMultiWriter,
            ]
            .iter()
            .any(|m| *m as i32 == mode)
        });
        Ok(Response::new(if node_local {
            ValidateVolumeCapabilitiesResponse {
                confirmed: Some(validate_volume_capabilities_response::Confirmed {
                    volume_context: r.volume_context,
                    volume_capabilities: r.volume_capabilities,
                    parameters: r.parameters,
                }),
                message: String::new(),
            }
        } else {
            ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: "a loop volume is on one node: only single-node access modes".into(),
            }
        }))
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        use controller_service_capability::{rpc, Rpc, Type};
        let cap = |t: rpc::Type| ControllerServiceCapability {
            r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })),
        };
        let mut capabilities = vec![
            cap(rpc::Type::CreateDeleteVolume),
            cap(rpc::Type::PublishUnpublishVolume),
            cap(rpc::Type::ExpandVolume),
            cap(rpc::Type::CloneVolume),
            cap(rpc::Type::CreateDeleteSnapshot),
        ];
        if !self.controller_publish {
            capabilities.remove(1);
        }
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn controller_expand_volume(
        &self,
        req: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        let r = req.into_inner();
        check_id(&r.volume_id)?;
        let want = r.capacity_range.map_or(0, |c| c.required_bytes);
        let node = r.volume_capability.as_ref().is_none_or(|c| !is_block(c));
        let image = self.image(&r.volume_id);
        let id = r.volume_id.clone();
        self.call("ControllerExpandVolume", &r.volume_id, "", move || {
            let have = grow_image(&image, &id, want)?;
            Ok(ControllerExpandVolumeResponse {
                capacity_bytes: have,
                node_expansion_required: node,
            })
        })
        .await
    }
}

/// A call of an RPC the controller does not offer (a CO must not make it).
fn not_offered(method: &str) -> Status {
    Status::unimplemented(format!(
        "{method}: this controller does not offer PUBLISH_UNPUBLISH_VOLUME"
    ))
}

/// The ID of the volume or snapshot made for request `name`: the name itself where it can be a
/// file name, else `<prefix>-` and a digest of it.
fn id_of(name: &str, prefix: &str) -> String {
    if check_id(name).is_ok() {
        return name.to_string();
    }
    let h = Sha256::digest(name.as_bytes());
    format!(
        "{prefix}-{}",
        h.iter()
            .take(10)
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    )
}

/// Makes `image` a copy of `from` (the image of `kind` `id`), grown to `size` bytes if that is
/// more; returns its size. What the node has written but not yet flushed is flushed first (a
/// crash-consistent copy, as a snapshot of a disk in use is). A size below the source's is out
/// of range: a volume cannot start smaller than its content.
fn copy_image(image: &Path, from: &Path, size: i64, kind: &str, id: &str) -> Result<i64, Status> {
    if let Ok(m) = std::fs::metadata(image) {
        return Ok(m.len() as i64);
    }
    let have = std::fs::metadata(from)
        .map_err(|_| Status::not_found(format!("{kind} {id} does not exist")))?
        .len() as i64;
    if size > 0 && size < have {
        return Err(Status::out_of_range(format!(
            "{size} bytes is less than the {have} bytes of {kind} {id}"
        )));
    }
    rustix::fs::sync();
    let size = size.max(have);
    place_image(image, size, |tmp| std::fs::copy(from, tmp).map(drop))?;
    Ok(size)
}
