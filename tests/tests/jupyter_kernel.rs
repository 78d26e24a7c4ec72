//! A real Jupyter kernel (ipykernel: ZeroMQ over loopback TCP, a dozen threads, eventfds,
//! epolls, a SQLite history, a loopback connection to its own shell port), driven the way JupyterLab drives it: with jupyter_client from
//! outside the checkpointed tree. Evicted and restored, the kernel keeps its variables and its
//! execution count, a new client (a browser reconnecting) gets answers, and so does the client
//! that stayed connected across the eviction. A `--leave-running` checkpoint taken while a
//! client asks for kernel_info over and over only pauses it.
//!
//! Needs a Python with ipykernel and jupyter_client: `STASIS_VENV_PYTHON`, else
//! `.stasis/venv/bin/python`, as scripts/test.sh sets them up; fails when there is none.

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Instant, SystemTime};

use serde_json::{Value, json};
use stasis_tests::{Daemon, TIMEOUT, expect_within, free_port, procfs, skip_unless_ready, workload_script};

/// The cell that builds the kernel's state.
const STATE: &str = "try:\n    import numpy\nexcept ImportError:\n    pass\n\
    x = list(range(1_000_000)); import hashlib; h = hashlib.sha256(str(x).encode()).hexdigest(); counter = 41";

/// Writes a kernel connection file on five free loopback ports; returns its path and the ports.
fn connection_file(d: &Daemon) -> (PathBuf, Vec<u16>) {
    let ports: Vec<u16> = (0..5).map(|_| free_port()).collect();
    let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).expect("clock").as_nanos();
    let info = json!({
        "ip": "127.0.0.1", "transport": "tcp", "signature_scheme": "hmac-sha256", "kernel_name": "python3",
        "key": format!("{nanos:032x}"), "shell_port": ports[0], "iopub_port": ports[1],
        "stdin_port": ports[2], "control_port": ports[3], "hb_port": ports[4],
    });
    let path = d.dir().join("kernel.json");
    std::fs::write(&path, info.to_string()).expect("writing the connection file");
    (path, ports)
}

/// One client connection to the kernel: `tests/workloads/kernel_client.py` (jupyter_client's
/// BlockingKernelClient), asked one JSON request at a time.
struct Client {
    child: Child,
    stdin: ChildStdin,
    replies: Receiver<String>,
}

impl Client {
    fn connect(python: &str, connection: &Path) -> Client {
        let mut child = Command::new(python)
            .arg(workload_script("kernel_client.py"))
            .arg(connection)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the kernel client");
        let (tx, replies) = channel();
        let stdout = BufReader::new(child.stdout.take().expect("client stdout"));
        std::thread::spawn(move || stdout.lines().map_while(Result::ok).try_for_each(|l| tx.send(l)));
        let stdin = child.stdin.take().expect("client stdin");
        let client = Client { child, stdin, replies };
        let ready = client.reply("the client to connect");
        assert_eq!(ready["ready"], true, "the client could not connect to the kernel: {ready}");
        client
    }

    /// The client's next reply; it times out itself after TIMEOUT, so this waits a bit longer.
    fn reply(&self, what: &str) -> Value {
        let line =
            self.replies.recv_timeout(TIMEOUT * 2).unwrap_or_else(|e| panic!("{what}: no reply ({e})"));
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {line}"))
    }

    fn ask(&mut self, request: Value) -> Value {
        writeln!(self.stdin, "{request}").expect("writing to the kernel client");
        let reply = self.reply(&request.to_string());
        assert_eq!(reply["status"], "ok", "{request}: {reply}");
        reply
    }

    /// Runs `code` in the kernel; returns the cell's execution count and what it printed.
    fn run(&mut self, code: &str) -> (u64, String) {
        let reply = self.ask(json!({"op": "execute", "code": code}));
        let count =
            reply["execution_count"].as_u64().unwrap_or_else(|| panic!("no execution count: {reply}"));
        (count, reply["stdout"].as_str().unwrap_or_default().to_owned())
    }

    fn kernel_info(&mut self) {
        let info = self.ask(json!({"op": "info"}));
        assert_eq!(info["implementation"], "ipython", "kernel_info: {info}");
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a kernel as a workload of `d` on a new connection file; returns the workload and the
/// file, and its five ports.
fn start_kernel(d: &Daemon, python: &str) -> (stasis_tests::Workload, PathBuf, Vec<u16>) {
    let (connection, ports) = connection_file(d);
    // Its own IPython directory, so that the kernel's profile and history stay in the test's.
    let ipython_dir = d.dir().join("ipython");
    std::fs::create_dir_all(ipython_dir.join("profile_default")).expect("IPython directory");
    let argv: Vec<String> = [python, "-m", "ipykernel_launcher", "-f", &connection.to_string_lossy()]
        .into_iter()
        .map(str::to_owned)
        .chain([format!("--ipython-dir={}", ipython_dir.display())])
        .collect();
    (d.run("jupyter", &argv), connection, ports)
}

#[test]
fn ipykernel_keeps_its_state_across_eviction_and_answers_through_leave_running() {
    skip_unless_ready!();
    let python = stasis_tests::venv_python("ipykernel, jupyter_client");
    let d = Daemon::start();
    let (mut w, connection, ports) = start_kernel(&d, &python);

    let mut tab = Client::connect(&python, &connection);
    let (before, _) = tab.run(STATE);
    let (_, h) = tab.run("print(h)");
    assert_eq!(h.trim().len(), 64, "the digest the kernel holds: {h:?}");

    // Eviction, with `tab` connected all along (left open, as a browser tab).
    let started = Instant::now();
    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    eprintln!("eviction took {:?}: {}", started.elapsed(), ck["stats"]);
    assert_eq!(ck["left_running"], false, "checkpoint result: {ck}");
    procfs::wait_gone(w.pid, "the evicted kernel to be gone");
    let id = ck["id"].as_str().expect("checkpoint id");
    let shown = d.json(&["show", id, "--json"]);
    let sockets: Vec<&str> =
        shown["sockets"].as_array().expect("sockets").iter().filter_map(|s| s.as_str()).collect();
    // Each of the five channels: the kernel's listener, and `tab`'s connection to it (the
    // client connects no heartbeat channel: ports[4]).
    for (i, port) in ports.iter().enumerate() {
        let listen = format!("tcp listen 127.0.0.1:{port},");
        let tab_conn = format!("tcp established 127.0.0.1:{port} -> ");
        let listed = |what: &str, also: &str| sockets.iter().any(|s| s.starts_with(what) && s.contains(also));
        assert!(listed(&listen, ""), "`show` should list {listen:?}: {sockets:#?}");
        assert!(
            i == 4 || listed(&tab_conn, "(peer outside the tree)"),
            "`show` should list {tab_conn:?}: {sockets:#?}"
        );
    }

    let started = Instant::now();
    let r = d.json(&["restore", "--workload", &w.name, "--json"]);
    eprintln!("restore took {:?}: {r}", started.elapsed());
    w.restored(&r);
    assert_eq!(r["warnings"].as_array().map(Vec::len), Some(0), "restore result: {r}");

    // A browser reconnecting: a new client on the same connection file.
    let mut again = Client::connect(&python, &connection);
    again.kernel_info();
    let (after, out) =
        again.run("counter += 1; print(counter, hashlib.sha256(str(x).encode()).hexdigest() == h)");
    assert_eq!(out, "42 True\n", "the restored kernel's state");
    assert!(after > before + 1, "the execution count should go on: {after} after {before}");
    assert_eq!(tab.run("print(counter)").1, "42\n", "on the client connected across the eviction");

    // --leave-running while `again` keeps asking: the kernel answers all through.
    let (ck, _) = d.checkpoint_while(&w.name, || again.kernel_info());
    assert_eq!(ck["left_running"], true, "checkpoint result: {ck}");
    assert!(procfs::running(w.pid), "the kernel after the checkpoint: state {:?}", procfs::proc_state(w.pid));
    let (last, out) = again.run("counter += 1; print(counter)");
    assert_eq!(out, "43\n", "after checkpoint --leave-running");
    assert!(last > after, "the execution count should go on: {last} after {after}");
    again.kernel_info();
}

#[test]
fn an_idle_kernel_is_reclaimed_and_its_client_wakes_it_by_running_a_cell() {
    skip_unless_ready!();
    let python = stasis_tests::venv_python("ipykernel, jupyter_client");
    let d = Daemon::start();
    let (w, connection, _) = start_kernel(&d, &python);
    let mut tab = Client::connect(&python, &connection);
    let (first, _) = tab.run("x = 41");
    // From now on the kernel is reclaimed after 3 s of doing nothing; the client goes quiet.
    d.ok(&["idle", &w.name, "--after", "3s"]);
    let reclaimed = expect_within(TIMEOUT * 3, "the kernel to be reclaimed", || {
        let status = d.workloads().into_iter().find(|s| s["name"] == w.name.as_str())?;
        (status["state"] == "reclaimed").then_some(status)
    });
    procfs::wait_gone(w.pid, "the reclaimed kernel to be gone");
    assert!(!reclaimed["reclaimed_checkpoint"].as_str().unwrap_or_default().is_empty(), "{reclaimed}");

    // The same client, on its same connections, with no retry of its own: its request is held
    // by the network lock until the kernel is back.
    let started = Instant::now();
    let (next, out) = tab.run("print(x + 1)");
    eprintln!("woken and answered in {:?}", started.elapsed());
    assert_eq!(out, "42\n", "the woken kernel's state");
    assert_eq!(next, first + 1, "the execution count goes on");
    let woken = stasis_tests::pid_of(&d.workload(&w.name));
    assert!(procfs::running(woken), "the kernel runs again as pid {woken}");
    // A browser reconnecting meanwhile gets answers too.
    let mut again = Client::connect(&python, &connection);
    assert_eq!(again.run("print(x)").1, "41\n");
}
