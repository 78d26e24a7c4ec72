//! Telling stasisd, over its API socket, what the runtime reports. Each call runs as a task of
//! its own: the runtime's request is answered before stasisd is.

use std::path::PathBuf;

use stasis_proto::stasis::v1::stasis_client::StasisClient;
use stasis_proto::stasis::v1::{ForgetContainerRequest, RegisterContainerRequest};
use tracing::{info, warn};

use crate::plugin::Stasisd;

/// stasisd at its API socket.
#[derive(Debug, Clone)]
pub struct Api {
    pub socket: PathBuf,
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
    fn register(&self, container: RegisterContainerRequest) {
        let api = self.clone();
        tokio::spawn(async move {
            let id = container.id.clone();
            let answer = match api.client().await {
                Ok(mut client) => {
                    client.register_container(container).await.map_err(|s| s.message().to_owned())
                }
                Err(e) => Err(e),
            };
            match answer {
                Ok(r) => {
                    info!(container = %id, workload = %r.into_inner().workload, "registered with stasisd")
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
