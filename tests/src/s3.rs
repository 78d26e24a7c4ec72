//! A real S3-compatible server for tests: moto's server on a free loopback port (installed by
//! scripts/test.sh into .stasis/venv), with a bucket, and the options that point stasisd at it.

use std::path::PathBuf;
use std::process::Command;

use crate::DaemonOptions;
use crate::emulator::{Emulator, daemon_options, present, request};

pub const BUCKET: &str = "stasis-test";

/// A moto S3 server, killed on drop.
pub struct S3Server {
    server: Emulator,
    pub port: u16,
}

impl S3Server {
    /// Starts a server with an empty bucket [`BUCKET`]; `None` (after saying so on stderr)
    /// where moto is not installed.
    pub fn start() -> Option<S3Server> {
        let moto = std::env::var_os("STASIS_MOTO").map(PathBuf::from).unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.stasis/venv/bin/moto_server")
        });
        if !present(&moto, "moto_server") {
            return None;
        }
        let command = |port: u16| {
            let mut moto = Command::new(&moto);
            moto.args(["-H", "127.0.0.1", "-p", &port.to_string()]);
            moto
        };
        let server = Emulator::start("moto_server", command, |port| {
            let answer = request(port, "PUT", &format!("/{BUCKET}"), &[], &[])
                .map_err(|e| format!("creating the bucket: {e}"))?;
            match answer.starts_with("HTTP/1.1 200") {
                true => Ok(()),
                false => Err(format!("creating the bucket: {answer}")),
            }
        });
        Some(S3Server { port: server.port, server })
    }

    /// How many multipart uploads of the bucket are begun and neither completed nor aborted
    /// (their parts are kept, and billed, on a real bucket).
    pub fn unfinished_uploads(&self) -> usize {
        let answer =
            request(self.port, "GET", &format!("/{BUCKET}?uploads"), &[], &[]).expect("listing uploads");
        assert!(answer.starts_with("HTTP/1.1 200"), "listing uploads: {answer}");
        answer.matches("<Upload>").count()
    }

    pub fn pid(&self) -> i32 {
        self.server.pid()
    }

    /// Options for a stasisd storing under `prefix` of the bucket, with extra `args`.
    pub fn daemon_options(&self, prefix: &str, args: &[&str]) -> DaemonOptions {
        self.daemon_options_at(self.port, prefix, args)
    }

    /// The same, reaching the server through a proxy on `port` (see [`crate::proxy`]).
    pub fn daemon_options_at(&self, port: u16, prefix: &str, args: &[&str]) -> DaemonOptions {
        let env = [
            ("AWS_ACCESS_KEY_ID", "test".to_string()),
            ("AWS_SECRET_ACCESS_KEY", "test".to_string()),
            ("AWS_DEFAULT_REGION", "us-east-1".to_string()),
            ("AWS_ALLOW_HTTP", "true".to_string()),
            ("AWS_ENDPOINT", format!("http://127.0.0.1:{port}")),
        ];
        daemon_options(format!("s3://{BUCKET}/{prefix}"), args, &env)
    }
}
