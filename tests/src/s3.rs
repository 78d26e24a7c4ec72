//! A real S3-compatible server for tests: moto's server on a free loopback port (installed by
//! scripts/test.sh into .stasis/venv), with a bucket, and the options that point stasisd at it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use crate::{DaemonOptions, TIMEOUT};

pub const BUCKET: &str = "stasis-test";

/// A moto S3 server, killed on drop.
pub struct S3Server {
    child: Child,
    pub port: u16,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl S3Server {
    /// Starts a server with an empty bucket [`BUCKET`]; `None` (after saying so on stderr)
    /// where moto is not installed.
    pub fn start() -> Option<S3Server> {
        let moto = std::env::var_os("STASIS_MOTO").map(PathBuf::from).unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.stasis/venv/bin/moto_server")
        });
        if !moto.exists() {
            eprintln!("skipping: moto_server not installed (scripts/test.sh installs it)");
            return None;
        }
        // A free port can be taken by another test's server before moto binds it (moto then
        // exits, and the other server may even answer once): on any sign of that, try again on
        // another port.
        for _ in 0..5 {
            let port = crate::free_port();
            let child = Command::new(&moto)
                .args(["-H", "127.0.0.1", "-p", &port.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("starting moto_server");
            let mut server = S3Server { child, port };
            match server.create_bucket() {
                Ok(()) => return Some(server),
                Err(why) => eprintln!("moto_server on port {port}: {why}; trying another port"),
            }
        }
        panic!("moto_server did not come up with a bucket on any of five ports");
    }

    /// Waits until our moto listens, then creates [`BUCKET`].
    fn create_bucket(&mut self) -> Result<(), String> {
        let port = self.port;
        let deadline = std::time::Instant::now() + TIMEOUT;
        let mut conn = loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("it exited ({status})"));
            }
            if let Ok(conn) = TcpStream::connect(("127.0.0.1", port)) {
                break conn;
            }
            if std::time::Instant::now() >= deadline {
                return Err("it never listened".into());
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        let answer = request(&mut conn, port, "PUT", &format!("/{BUCKET}"))
            .map_err(|e| format!("creating the bucket: {e}"))?;
        match answer.starts_with("HTTP/1.1 200") {
            true => Ok(()),
            false => Err(format!("creating the bucket: {answer}")),
        }
    }

    /// How many multipart uploads of the bucket are begun and neither completed nor aborted
    /// (their parts are kept, and billed, on a real bucket).
    pub fn unfinished_uploads(&self) -> usize {
        let mut conn = TcpStream::connect(("127.0.0.1", self.port)).expect("the S3 server");
        let answer =
            request(&mut conn, self.port, "GET", &format!("/{BUCKET}?uploads")).expect("listing uploads");
        assert!(answer.starts_with("HTTP/1.1 200"), "listing uploads: {answer}");
        answer.matches("<Upload>").count()
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Options for a stasisd storing under `prefix` of the bucket, with extra `args`.
    pub fn daemon_options(&self, prefix: &str, args: &[&str]) -> DaemonOptions {
        self.daemon_options_at(self.port, prefix, args)
    }

    /// The same, reaching the server through a proxy on `port` (see [`crate::proxy`]).
    pub fn daemon_options_at(&self, port: u16, prefix: &str, args: &[&str]) -> DaemonOptions {
        let env = [
            ("AWS_ACCESS_KEY_ID", "test"),
            ("AWS_SECRET_ACCESS_KEY", "test"),
            ("AWS_DEFAULT_REGION", "us-east-1"),
            ("AWS_ALLOW_HTTP", "true"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .into_iter()
        .chain([("AWS_ENDPOINT".to_string(), format!("http://127.0.0.1:{port}"))])
        .collect();
        DaemonOptions {
            store: Some(format!("s3://{BUCKET}/{prefix}")),
            args: args.iter().map(|a| a.to_string()).collect(),
            env,
        }
    }
}

/// Sends one request without a body on `conn` and reads the whole answer.
fn request(conn: &mut TcpStream, port: u16, method: &str, path: &str) -> std::io::Result<String> {
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    let mut answer = String::new();
    conn.write_all(head.as_bytes())?;
    conn.read_to_string(&mut answer)?;
    Ok(answer)
}
