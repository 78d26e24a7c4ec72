//! One module per subcommand; `execute` connects to stasisd and dispatches.

use std::path::Path;

use anyhow::bail;
use stasis_proto::stasis::v1::Progress;
use stasis_proto::tonic::Streaming;

use crate::args::Command;
use crate::client::Client;
use crate::progress::ProgressLine;

mod archive;
mod check;
mod checkpoint;
mod container;
mod delete;
mod evacuate;
mod gc;
mod idle;
mod list;
mod restore;
mod run;
mod show;
mod status;

/// Runs `command` against the stasisd listening on `socket`.
pub async fn execute(socket: &Path, command: Command) -> anyhow::Result<()> {
    let mut client = Client::connect(socket).await?;
    match command {
        Command::Run(args) => run::run(&mut client, args).await,
        Command::Checkpoint(args) => checkpoint::run(&mut client, args).await,
        Command::Restore(args) => restore::run(&mut client, args).await,
        Command::List(args) => list::run(&mut client, args).await,
        Command::Show(args) => show::run(&mut client, args).await,
        Command::Delete(args) => delete::run(&mut client, args).await,
        Command::Gc(args) => gc::run(&mut client, args).await,
        Command::Check(args) => check::run(&mut client, args).await,
        Command::Status(args) => status::run(&mut client, args).await,
        Command::Idle(args) => idle::set(&mut client, args).await,
        Command::Wake(args) => idle::wake(&mut client, args).await,
        Command::Periodic(args) => idle::periodic(&mut client, args).await,
        Command::Spot(args) => evacuate::spot(&mut client, args).await,
        Command::Evacuate(args) => evacuate::run(&mut client, args).await,
        Command::Export(args) => archive::export(&mut client, args).await,
        Command::Import(args) => archive::import(&mut client, args).await,
        Command::Container(command) => container::run(&mut client, command).await,
    }
}

/// What one event of a streaming operation carries.
enum Step<R> {
    Progress(Progress),
    Done(R),
}

/// Follows a stream of progress events up to its result, showing progress on stderr
/// unless `json` is set.
async fn follow<E, R>(
    client: &Client,
    mut stream: Streaming<E>,
    json: bool,
    step: impl Fn(E) -> Option<Step<R>>,
) -> anyhow::Result<R> {
    let mut line = ProgressLine::new(!json);
    while let Some(event) = stream.message().await.map_err(|s| client.error(s))? {
        match step(event) {
            Some(Step::Progress(progress)) => line.update(&progress),
            Some(Step::Done(result)) => return Ok(result),
            // An event this CLI does not know, from a newer daemon.
            None => {}
        }
    }
    bail!("stasisd ended the operation without a result")
}
