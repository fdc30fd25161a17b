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
        let id = if check_id(&r.name).is_ok() {
            r.name.clone()
        } else {
            let h = Sha256::digest(r.name.as_bytes());
            format!(
                "loop-{}",
                h.iter()
                    .take(10)
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
            )
        };
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
        // A loop device exists on its node only: the volume is where it was asked to be (the
        // first preferred or requisite topology), which for this driver is its own node.
        let topology: Vec<Topology> = r
            .accessibility_requirements
            .and_then(|t| t.preferred.into_iter().chain(t.requisite).next())
            .into_iter()
            .collect();
        self.call("CreateVolume", &id.clone(), "", move || {
            let have = create_image(&image, size)?;
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
