//! A job started from a terminal, outside stasis, is checkpointed by pid and restored with a
//! new terminal whose output reaches the workload log; and stasisd refuses to start, saying
//! what to do, when CRIU is missing.

#![forbid(unsafe_code)]

use std::process::{Command, Stdio};

use stasis_tests::{
    Daemon, TIMEOUT, bin, expect_within, numbered, procfs, python_workload, skip_unless_ready,
};

#[test]
fn a_job_on_a_terminal_is_checkpointed_by_pid_and_restored() {
    skip_unless_ready!();
    let d = Daemon::start();
    // `script` runs the job on a new pseudo-terminal, as an interactive shell would, and
    // copies what the job prints there to `typescript`.
    let job = python_workload("counter.py", &[]).join(" ");
    let typescript = d.dir().join("typescript");
    let mut terminal = Command::new("script")
        .args(["-qfc", &job])
        .arg(&typescript)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("starting script");
    let pid = expect_within(TIMEOUT, "the job under the terminal", || {
        procfs::children(terminal.id() as i32)
            .into_iter()
            .find(|p| procfs::cmdline(*p).is_some_and(|c| c.iter().any(|a| a.ends_with("counter.py"))))
    });
    let counted = expect_within(TIMEOUT, "the job to count on its terminal", || {
        numbered(&stasis_tests::complete_lines(&typescript), "count ").last().copied().filter(|n| *n >= 3)
    });
    let ck = d.json(&["checkpoint", &pid.to_string(), "--json"]);
    let workload = ck["workload"].as_str().unwrap().to_owned();
    let shown = d.json(&["show", ck["id"].as_str().unwrap(), "--json"]);
    let options = shown["criu_options"].to_string();
    assert!(options.contains("external tty["), "the terminal is handled as external: {options}");
    let _ = terminal.kill();
    let _ = terminal.wait();
    procfs::wait_gone(pid, "the evicted job to be gone");

    let restored = d.json(&["restore", ck["id"].as_str().unwrap(), "--json"]);
    assert_eq!(restored["pid"].as_i64(), Some(i64::from(pid)));
    let log = d.dir().join("state/logs").join(format!("{workload}.log"));
    let counts = expect_within(TIMEOUT, "counting on the new terminal", || {
        let lines = stasis_tests::complete_lines(&log);
        let n = numbered(&lines, "count ");
        (n.len() >= 3).then_some(n)
    });
    assert!(
        counts[0] >= counted,
        "the restored job continues from count {counted} or later, it does not start over: {counts:?}"
    );
    assert!(counts.windows(2).all(|w| w[1] == w[0] + 1), "{counts:?}");
    procfs::kill9(pid);
}

#[test]
fn stasisd_refuses_to_start_without_criu() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(bin("stasisd"))
        .arg("--socket")
        .arg(dir.path().join("s.sock"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args(["--criu", "/nonexistent/criu"])
        .output()
        .expect("running stasisd");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("CRIU not found at /nonexistent/criu"), "{stderr}");
    assert!(stderr.contains("setup-criu.sh"), "the message says what to do: {stderr}");
    assert!(!dir.path().join("s.sock").exists(), "no socket is served");
}

#[test]
fn stasisd_refuses_a_cloud_store_without_credentials_naming_what_to_set() {
    skip_unless_ready!();
    // On no cloud (this machine), with no credentials in the environment: object_store would
    // ask a metadata service at 169.254.169.254 or metadata.google.internal.
    let dir = tempfile::tempdir().unwrap();
    for (url, variable) in [
        ("gs://stasis-test/x", "GOOGLE_APPLICATION_CREDENTIALS"),
        ("s3://stasis-test/x", "AWS_ACCESS_KEY_ID"),
        ("az://stasis-test/x", "AZURE_STORAGE_ACCOUNT_KEY"),
    ] {
        let mut stasisd = Command::new(bin("stasisd"));
        stasisd.env_clear().env("PATH", std::env::var_os("PATH").unwrap_or_default()).env("HOME", dir.path());
        let out = stasisd
            .arg("--socket")
            .arg(dir.path().join("s.sock"))
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(["--store", url])
            .output()
            .expect("running stasisd");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{url}: {stderr}");
        assert!(stderr.contains(&format!("cannot use the store at {url}: no ")), "{url}: {stderr}");
        assert!(stderr.contains(variable), "{url}: the message names what to set: {stderr}");
        assert!(!stderr.contains("169.254") && !stderr.contains("metadata.google"), "{url}: {stderr}");
    }
}
