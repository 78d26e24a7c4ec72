//! Telling stasisd, over its API socket, what the runtime reports. Each call runs as a task of
//! its own: the runtime's request is answered before stasisd is.

use std::path::PathBuf;

use stasis_proto::cri::ContainerStatusRequest;
use stasis_proto::cri::runtime_service_client::RuntimeServiceClient;
use stasis_proto::stasis::v1::stasis_client::StasisClient;
use stasis_proto::stasis::v1::{ForgetContainerRequest, RegisterContainerRequest};
use tracing::{info, warn};

use crate::plugin::Stasisd;

/// stasisd at its API socket; the runtime's CRI socket, if given, names containers' images
/// by digest.
#[derive(Debug, Clone)]
pub struct Api {
    pub socket: PathBuf,
    pub cri_socket: Option<PathBuf>,
}

impl Api {
    async fn client(&self) -> Result<StasisClient<stasis_proto::tonic::transport::Channel>, String> {
        let channel = stasis_proto::unix_channel(&self.socket).await;
        channel
            .map(StasisClient::new)
            .map_err(|e| format!("cannot reach stasisd at {}: {e}", self.socket.display()))
    }
}

impl Stasisd for Api {
    fn register(&self, mut container: RegisterContainerRequest) {
        let api = self.clone();
        tokio::spawn(async move {
            let id = container.id.clone();
            // A tag may be pushed again with other contents: the digest tells images apart.
            if let Some(cri) = &api.cri_socket {
                match image_digest(cri, &id).await {
                    Ok(digest) => container.image = digest,
                    Err(e) => {
                        warn!(container = %id, error = %e, "no image digest from the runtime; keeping its image name")
                    }
                }
            }
            let image = container.image.clone();
            let answer = match api.client().await {
                Ok(mut client) => {
                    client.register_container(container).await.map_err(|s| s.message().to_owned())
                }
                Err(e) => Err(e),
            };
            match answer {
                Ok(r) => {
                    info!(container = %id, workload = %r.into_inner().workload, %image, "registered with stasisd")
                }
                Err(e) => warn!(container = %id, error = %e, "stasisd did not take the container"),
            }
        });
    }

    fn forget(&self, id: String) {
        let api = self.clone();
        tokio::spawn(async move {
            let answer = match api.client().await {
                Ok(mut client) => client
                    .forget_container(ForgetContainerRequest { id: id.clone() })
                    .await
                    .map_err(|s| s.message().to_owned()),
                Err(e) => Err(e),
            };
            if let Err(e) = answer {
                warn!(container = %id, error = %e, "stasisd did not forget the container");
            }
        });
    }
}

/// The digest of the image container `id` runs, as the runtime at CRI socket `cri` resolved it.
async fn image_digest(cri: &std::path::Path, id: &str) -> Result<String, String> {
    let channel = stasis_proto::unix_channel(cri)
        .await
        .map_err(|e| format!("cannot reach the CRI at {}: {e}", cri.display()))?;
    let request = ContainerStatusRequest { container_id: id.to_owned(), verbose: false };
    let status = RuntimeServiceClient::new(channel)
        .container_status(request)
        .await
        .map_err(|s| s.message().to_owned())?;
    match status.into_inner().status.map(|s| s.image_ref).filter(|r| !r.is_empty()) {
        Some(digest) => Ok(digest),
        None => Err("the runtime names no image".into()),
    }
}
