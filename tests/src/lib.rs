//! Harness of the end-to-end tests: a real `stasisd` in a temporary directory, driven through
//! the real `stasis` CLI, checkpointing and restoring real processes with real CRIU.
//!
//! Every test starts with [`skip_unless_ready!`]: without root or without CRIU it says so on
//! stderr and returns (a visible skip, never a silent pass); without the workspace's binaries
//! it panics, because that is a build problem and not a property of the machine.

#![forbid(unsafe_code)]

pub mod azurite;
pub mod containerd;
pub mod corpus;
mod daemon;
pub mod disk;
mod emulator;
pub mod gcs;
mod http;
pub mod http_faults;
pub mod imds;
pub mod kube;
mod logs;
pub mod memtest;
mod peer;
pub mod podman;
pub mod preload;
pub mod procfs;
pub mod proxy;
pub mod resp;
pub mod s3;
mod workload;

use std::path::{Path, PathBuf};

pub use daemon::{Daemon, DaemonOptions, pid_of};
pub use http::HttpConn;
pub use logs::{complete_lines, expect_within, numbered, wait_for};
pub use peer::EchoPeer;
pub use workload::Workload;

/// Generous bound for anything a test waits on: the CI machine has two slow cores.
pub const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// Returns from the calling test, after saying why on stderr, unless this machine can run
/// end-to-end tests (root and CRIU); panics when the workspace's binaries were not built.
#[macro_export]
macro_rules! skip_unless_ready {
    () => {{
        fn here() {}
        let test = $crate::test_name(::std::any::type_name_of_val(&here));
        if let Err(why) = $crate::readiness() {
            eprintln!("skipping {test}: {why}");
            return;
        }
    }};
}

/// The test's function name, from the type name of a function nested in it
/// (`crate::module::test_fn::here`).
pub fn test_name(nested_fn_type_name: &str) -> &str {
    let path = nested_fn_type_name.strip_suffix("::here").unwrap_or(nested_fn_type_name);
    path.rsplit("::").next().unwrap_or(path)
}

/// `Err(why)` when end-to-end tests cannot run on this machine. Panics when they could but
/// the binaries under test are missing.
pub fn readiness() -> Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("end-to-end tests need root (CRIU dumps and restores process trees)".into());
    }
    let criu = criu_path();
    if !criu.exists() {
        return Err(format!("no CRIU at {} (run scripts/setup-criu.sh)", criu.display()));
    }
    for bin in ["stasisd", "stasis"] {
        let path = bin_dir().join(bin);
        assert!(
            path.exists(),
            "{} is missing: build the workspace first (cargo build --workspace)",
            path.display()
        );
    }
    Ok(())
}

/// The CRIU stasisd will use: `STASIS_CRIU` when set, else the one `scripts/setup-criu.sh`
/// installs under `.stasis/criu`.
pub fn criu_path() -> PathBuf {
    match std::env::var_os("STASIS_CRIU") {
        Some(path) => PathBuf::from(path),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../.stasis/criu/bin/criu"),
    }
}

/// `target/<profile>/`, where cargo puts the workspace's binaries: the test executable is
/// `target/<profile>/deps/<name>-<hash>`.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("path of the test executable");
    let deps = exe.parent().expect("the test executable has a directory");
    let dir = if deps.ends_with("deps") { deps.parent().expect("deps has a parent") } else { deps };
    dir.to_path_buf()
}

/// Path of a binary of the workspace (`stasisd`, `stasis`, `stasis-memtest`).
pub fn bin(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.exists(),
        "{} is missing: build the workspace first (cargo build --workspace)",
        path.display()
    );
    path
}

/// Path of a test workload script in `tests/workloads/`.
pub fn workload_script(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("workloads").join(name);
    assert!(path.exists(), "missing workload {}", path.display());
    path.to_string_lossy().into_owned()
}

/// An absolute Python 3 interpreter: the system's when there is one (so that no shim or
/// wrapper sits in the checkpointed tree), else the first `python3` on `PATH`.
pub fn python() -> String {
    let system = Path::new("/usr/bin/python3");
    if system.exists() {
        return system.to_string_lossy().into_owned();
    }
    std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|dir| dir.join("python3")).find(|p| p.exists()))
        .map(|p| p.to_string_lossy().into_owned())
        .expect("python3 is needed by the test workloads")
}

/// A loopback port nothing listens on right now.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free loopback port");
    listener.local_addr().expect("listener address").port()
}

/// The body of `GET /` from an HTTP server on loopback `port`.
pub fn http_get(port: u16) -> Result<String, String> {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    conn.set_read_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
    conn.write_all(b"GET / HTTP/1.0\r\n\r\n").map_err(|e| e.to_string())?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer).map_err(|e| e.to_string())?;
    answer.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).ok_or(answer)
}

/// The path of program `name` as Debian installs it (`/usr/bin`, `/usr/sbin`), else the first
/// on `PATH`; `None` when it is not installed.
pub fn installed(name: &str) -> Option<String> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    ["/usr/bin", "/usr/sbin"]
        .into_iter()
        .map(PathBuf::from)
        .chain(std::env::split_paths(&path))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .map(|p| p.to_string_lossy().into_owned())
}

/// `n` pseudo-random bytes (xorshift64 from `seed`): no store compresses or deduplicates them.
pub fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15 ^ (seed + 1);
    let mut out: Vec<u8> = (0..n.div_ceil(8))
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    out.truncate(n);
    out
}

/// The command line running workload script `script` with `args`.
pub fn python_workload(script: &str, args: &[&str]) -> Vec<String> {
    let mut argv = vec![python(), workload_script(script)];
    argv.extend(args.iter().map(|a| a.to_string()));
    argv
}

/// The virtual environment's Python (`STASIS_VENV_PYTHON`, else `.stasis/venv/bin/python`, as
/// scripts/test.sh sets it up), checked to import `modules` (comma-separated); fails the test,
/// saying what to do, when it does not.
pub fn venv_python(modules: &str) -> String {
    let python = std::env::var("STASIS_VENV_PYTHON")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../.stasis/venv/bin/python").to_owned());
    let imports = std::process::Command::new(&python).args(["-c", &format!("import {modules}")]).output();
    assert!(
        imports.as_ref().is_ok_and(|out| out.status.success()),
        "{python} cannot import {modules}: run scripts/test.sh, which installs them in .stasis/venv (or \
         set STASIS_VENV_PYTHON to a Python that has them): {imports:?}"
    );
    python
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_name_is_the_last_path_segment_before_here() {
        assert_eq!(test_name("restore::counter_continues::here"), "counter_continues");
        assert_eq!(test_name("plain"), "plain");
    }
}
