//! Object-store emulators the tests run as processes (moto's S3 server, Azurite,
//! fake-gcs-server): each on a free loopback port, readied (a bucket created), killed on drop.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use crate::{DaemonOptions, TIMEOUT};

/// An emulator process listening on loopback `port`, killed on drop.
pub struct Emulator {
    child: Child,
    pub port: u16,
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Emulator {
    /// Runs `command(port)` on a free port, waits until it listens, then `ready(port)` (which
    /// creates the bucket). A free port can be taken by another test's server before ours
    /// binds it (ours then exits, and the other may even answer once): on any sign of that,
    /// it tries again on another port.
    pub(crate) fn start(
        name: &str,
        command: impl Fn(u16) -> Command,
        ready: impl Fn(u16) -> Result<(), String>,
    ) -> Emulator {
        for _ in 0..5 {
            let port = crate::free_port();
            let child = command(port)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("starting {name}: {e}"));
            let mut emulator = Emulator { child, port };
            match emulator.wait_listening().and_then(|()| ready(port)) {
                Ok(()) => return emulator,
                Err(why) => eprintln!("{name} on port {port}: {why}; trying another port"),
            }
        }
        panic!("{name} did not come up with a bucket on any of five ports");
    }

    fn wait_listening(&mut self) -> Result<(), String> {
        let deadline = std::time::Instant::now() + TIMEOUT;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("it exited ({status})"));
            }
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                return Err("it never listened".into());
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

/// Whether `path` exists; where not, says on stderr that the test is skipped because `what`
/// is not installed (scripts/test.sh installs it).
pub(crate) fn present(path: &Path, what: &str) -> bool {
    let there = path.exists();
    if !there {
        eprintln!("skipping: {what} is not installed at {} (scripts/test.sh installs it)", path.display());
    }
    there
}

/// Sends one request with `headers` and `body` to loopback `port` on a connection of its own,
/// and reads the whole answer.
pub(crate) fn request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<String> {
    let mut conn = TcpStream::connect(("127.0.0.1", port))?;
    conn.set_read_timeout(Some(TIMEOUT))?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    conn.write_all(head.as_bytes())?;
    conn.write_all(body)?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer)?;
    Ok(answer)
}

/// Options for a stasisd storing at `store` with extra `args` and environment `env`.
pub(crate) fn daemon_options(store: String, args: &[&str], env: &[(&str, String)]) -> DaemonOptions {
    DaemonOptions {
        store: Some(store),
        args: args.iter().map(|a| a.to_string()).collect(),
        env: env.iter().map(|(k, v)| (k.to_string(), v.clone())).collect(),
    }
}
