//! Which version of an API group serves a resource, as the server's discovery says: the
//! newest the node knows first. A default 1.37 cluster serves ClusterTrustBundles and
//! PodCertificateRequests at `certificates.k8s.io/v1` only (`v1beta1` answers 404 without
//! `--runtime-config`), a 1.36 one at `v1beta1` when it is turned on; a node reads what the
//! server it is given serves.

use std::sync::Mutex;
use std::time::Duration;

use kube::api::ApiResource;
use tokio::time::Instant;

use super::backoff::api_error;
use crate::error::ApiError;

/// How long a server's "not served" is believed before discovery asks again (an API turned on
/// since, a server upgraded).
const NOT_SERVED_FOR: Duration = Duration::from_secs(30);

/// A resource of an API group, and the version found to serve it.
pub(super) struct Served {
    client: kube::Client,
    group: &'static str,
    /// Newest first.
    versions: &'static [&'static str],
    kind: &'static str,
    plural: &'static str,
    /// What discovery last found: the version, or that none serves it (until when).
    found: Mutex<Option<Result<&'static str, Instant>>>,
}

impl Served {
    /// `plural` (of `kind`) in `group`, at the first of `versions` that the server serves.
    pub(super) fn new(
        client: kube::Client,
        group: &'static str,
        versions: &'static [&'static str],
        kind: &'static str,
        plural: &'static str,
    ) -> Self {
        Served {
            client,
            group,
            versions,
            kind,
            plural,
            found: Mutex::new(None),
        }
    }

    /// The group and versions, as a message names them (`certificates.k8s.io/v1 or v1beta1`).
    pub(super) fn spelled(&self) -> String {
        format!("{}/{}", self.group, self.versions.join(" or "))
    }

    fn resource_at(&self, version: &str) -> ApiResource {
        ApiResource {
            group: self.group.into(),
            version: version.into(),
            api_version: format!("{}/{version}", self.group),
            kind: self.kind.into(),
            plural: self.plural.into(),
        }
    }

    /// The resource at the version the server serves it at; [`ApiError::NotServed`] when it
    /// serves it at none of them.
    pub(super) async fn resource(
        &self,
        not_served: impl FnOnce() -> String,
    ) -> Result<ApiResource, ApiError> {
        let known = *crate::sync::lock(&self.found);
        match known {
            Some(Ok(version)) => return Ok(self.resource_at(version)),
            Some(Err(until)) if Instant::now() < until => {
                return Err(ApiError::NotServed(not_served()))
            }
            _ => {}
        }
        for version in self.versions {
            let gv = format!("{}/{version}", self.group);
            match self.client.list_api_group_resources(&gv).await {
                Ok(list) if list.resources.iter().any(|r| r.name == self.plural) => {
                    *crate::sync::lock(&self.found) = Some(Ok(version));
                    return Ok(self.resource_at(version));
                }
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => {
                    return Err(api_error(
                        format_args!("cannot ask the API server which version of {gv} it serves"),
                        &e,
                        ApiError::Waiting,
                    ))
                }
            }
        }
        *crate::sync::lock(&self.found) = Some(Err(Instant::now() + NOT_SERVED_FOR));
        Err(ApiError::NotServed(not_served()))
    }

    /// Forgets the version found (the server answered 404 at it): the next use asks again.
    pub(super) fn forget(&self) {
        *crate::sync::lock(&self.found) = None;
    }
}
