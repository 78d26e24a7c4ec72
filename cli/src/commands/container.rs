//! `stasis container`: what the NRI plugin tells stasisd of Kubernetes containers, by hand.

use stasis_proto::stasis::v1::{ForgetContainerRequest, RegisterContainerRequest};

use crate::args::{ContainerCommand, RegisterArgs};
use crate::client::Client;
use crate::output;

pub async fn run(client: &mut Client, command: ContainerCommand) -> anyhow::Result<()> {
    match command {
        ContainerCommand::Register(args) => register(client, args).await,
        ContainerCommand::Forget { id } => {
            let request = ForgetContainerRequest { id: id.clone() };
            client.rpc.forget_container(request).await.map_err(|s| client.error(s))?;
            output::print(&format!("container {id} forgotten"))
        }
    }
}

async fn register(client: &mut Client, args: RegisterArgs) -> anyhow::Result<()> {
    let request = RegisterContainerRequest {
        id: args.id.clone(),
        init_pid: args.init_pid,
        image: args.image,
        namespace: args.namespace,
        owner_kind: args.owner_kind,
        owner_name: args.owner_name,
        ordinal: args.ordinal,
        container: args.container,
        checkpoint_every_ms: args.checkpoint_every.map_or(0, |d| d.as_millis() as u64),
        any_image: args.any_image,
        gpu_devices: args.gpu_device,
    };
    let workload =
        client.rpc.register_container(request).await.map_err(|s| client.error(s))?.into_inner().workload;
    match args.json {
        true => output::print_json(&serde_json::json!({ "container": args.id, "workload": workload })),
        false => output::print(&format!("container {} is workload {workload}", args.id)),
    }
}
