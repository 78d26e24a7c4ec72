//! Connecting to stasisd over its Unix socket, and turning gRPC errors into readable ones.

use std::error::Error as _;
use std::path::{Path, PathBuf};

use anyhow::anyhow;
use stasis_proto::stasis::v1::stasis_client::StasisClient;
use stasis_proto::tonic::transport::Channel;
use stasis_proto::tonic::{Code, Status};

/// Printed with every "cannot reach the daemon" error.
const HINT: &str = "is stasisd running? set --socket or STASIS_SOCKET";

/// A connection to stasisd.
pub struct Client {
    /// The generated gRPC client.
    pub rpc: StasisClient<Channel>,
    socket: PathBuf,
}

impl Client {
    /// Connects to stasisd's socket at `socket`.
    pub async fn connect(socket: &Path) -> anyhow::Result<Self> {
        let channel = stasis_proto::unix_channel(socket).await.map_err(|e| {
            anyhow!("cannot reach stasisd at {}: {} ({HINT})", socket.display(), root_cause(&e))
        })?;
        Ok(Self { rpc: StasisClient::new(channel), socket: socket.to_path_buf() })
    }

    /// Turns an RPC failure into an error for the user.
    pub fn error(&self, status: Status) -> anyhow::Error {
        describe_status(&status, &self.socket)
    }
}

/// The daemon writes full sentences in status messages, so those are shown as they are; the
/// code is added only where it helps: when the daemon is unavailable.
fn describe_status(status: &Status, socket: &Path) -> anyhow::Error {
    let message = match status.message() {
        "" => format!("stasisd returned {:?}", status.code()),
        message => message.to_owned(),
    };
    match (status.code(), status.source()) {
        // A status with a source was made on our side from a transport error: the
        // connection to the daemon failed or broke.
        (Code::Unavailable, Some(source)) => anyhow!(
            "cannot reach stasisd at {}: {message}: {} ({HINT})",
            socket.display(),
            root_cause(source)
        ),
        (Code::Unavailable, None) => anyhow!("{message} (unavailable)"),
        _ => anyhow!(message),
    }
}

/// The innermost error of a chain: for a failed connection, the OS error.
fn root_cause<'a>(err: &'a (dyn std::error::Error + 'static)) -> &'a (dyn std::error::Error + 'static) {
    std::iter::successors(Some(err), |&e| e.source()).last().unwrap_or(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOCKET: &str = "/run/test.sock";

    fn describe(status: &Status) -> String {
        format!("{:#}", describe_status(status, Path::new(SOCKET)))
    }

    #[test]
    fn daemon_messages_are_shown_as_they_are() {
        let status = Status::not_found("checkpoint ck-1 does not exist.");
        assert_eq!(describe(&status), "checkpoint ck-1 does not exist.");
    }

    #[test]
    fn empty_messages_name_the_code() {
        assert_eq!(describe(&Status::new(Code::Internal, "")), "stasisd returned Internal");
    }

    #[test]
    fn unavailable_from_the_daemon_names_the_code() {
        let status = Status::unavailable("the store is unreachable.");
        assert_eq!(describe(&status), "the store is unreachable. (unavailable)");
    }

    #[test]
    fn transport_failures_name_the_socket_and_the_cause() {
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let mut status = Status::unavailable("connection error");
        status.set_source(std::sync::Arc::new(io));
        let text = describe(&status);
        assert!(text.starts_with("cannot reach stasisd at /run/test.sock: connection error: "), "{text}");
        assert!(text.contains("connection reset"), "{text}");
        assert!(text.ends_with(&format!("({HINT})")), "{text}");
    }

    #[tokio::test]
    async fn connecting_to_a_missing_socket_explains_how_to_fix_it() {
        let socket = Path::new("/nonexistent/stasis-test.sock");
        let Err(err) = Client::connect(socket).await else {
            panic!("connecting to {} should fail", socket.display());
        };
        let text = format!("{err:#}");
        assert!(text.starts_with("cannot reach stasisd at /nonexistent/stasis-test.sock: "), "{text}");
        assert!(text.contains("No such file or directory"), "{text}");
        assert!(text.ends_with(&format!("({HINT})")), "{text}");
    }
}
