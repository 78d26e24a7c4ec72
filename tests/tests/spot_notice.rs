//! Spot surfing against emulated cloud metadata services (tests/src/imds.rs, the real request
//! and answer shapes): a preemption notice makes every spot workload durable in its window
//! and leaves the others alone; another node sharing the S3 bucket restores the workload and
//! it goes on from where it was; a notice that comes while a checkpoint is under way still
//! evicts; Azure's event is acknowledged once all is durable; a metadata service that hangs
//! neither stalls stasisd nor keeps a later notice from being acted on.

#![forbid(unsafe_code)]

use std::process::Stdio;
use std::time::{Duration, SystemTime};

use serde_json::Value;
use stasis_tests::imds::{AZURE_VM, Cloud, Imds};
use stasis_tests::s3::S3Server;
use stasis_tests::{
    Daemon, DaemonOptions, TIMEOUT, expect_within, procfs, python_workload, skip_unless_ready,
};

/// How often the watchers ask in these tests.
const POLL_MS: u64 = 200;

/// The `evacuation` of workload `name` in `d`'s status, once it has one.
fn evacuation_of(d: &Daemon, name: &str) -> Option<Value> {
    let w = d.workloads().into_iter().find(|w| w["name"] == name)?;
    Some(w["evacuation"].clone()).filter(|e| !e.is_null())
}

/// Waits for the evacuation record of `name` and checks it is durable before its deadline.
fn wait_evacuated(d: &Daemon, name: &str, within: Duration) -> Value {
    let e = expect_within(within, &format!("{name} to be evacuated"), || evacuation_of(d, name));
    let (durable, deadline) =
        (e["durable_unix_ms"].as_u64().unwrap(), e["deadline_unix_ms"].as_u64().unwrap());
    assert!(!e["checkpoint"].as_str().unwrap().is_empty(), "not durable: {e}\n{}", d.log_tail(30));
    assert!(durable > 0 && durable <= deadline, "durable {durable} after the deadline {deadline}: {e}");
    e
}

#[test]
fn an_aws_notice_evicts_the_spot_workload_in_time_and_another_node_restores_it() {
    skip_unless_ready!();
    let Some(s3) = S3Server::start() else { return };
    let imds = Imds::start(Cloud::Aws);
    let watch = imds.daemon_args(POLL_MS);
    let a =
        Daemon::start_with(&s3.daemon_options("spot", &watch.iter().map(String::as_str).collect::<Vec<_>>()));
    let b = Daemon::start_with(&s3.daemon_options("spot", &[]));
    assert!(a.json(&["status", "--json"])["notices"].as_str().unwrap().starts_with("aws (http://127.0.0.1:"));

    // 1 GiB that stays still, checkpointed once before the notice (as a periodic one would).
    let mut big = a.run("big", &python_workload("memhog.py", &["1024"]));
    big.wait_line_after(0, "the 1 GiB workload to be ready", |l| l == "ready");
    a.ok(&["spot", &big.name, "--on"]);
    let mut counter = a.run("counter", &python_workload("counter.py", &[]));
    a.ok(&["spot", &counter.name, "--on"]);
    let bystander = a.run("bystander", &python_workload("counter.py", &[]));
    a.json(&["checkpoint", "--workload", &big.name, "--leave-running", "--json"]);
    let sum_before = checksum(&big, 0);
    counter.wait_number("count ", 3);

    // An early rebalance recommendation: checkpoints left running, nothing stops.
    imds.recommend_rebalance();
    for (w, count) in [(&counter, 1), (&big, 2)] {
        expect_within(TIMEOUT, &format!("the rebalance checkpoint of {}", w.name), || {
            let listed = a.json(&["list", "--workload", &w.name, "--json"]);
            (listed["checkpoints"].as_array().map(Vec::len) == Some(count)).then_some(())
        });
    }
    assert!(procfs::running(big.pid) && procfs::running(counter.pid), "a rebalance stops nothing");

    imds.preempt(SystemTime::now() + Duration::from_secs(10), "");
    let e = wait_evacuated(&a, &big.name, Duration::from_secs(15));
    assert!(e["cause"].as_str().unwrap().starts_with("aws: spot instance-action terminate"), "{e}");
    wait_evacuated(&a, &counter.name, Duration::from_secs(15));
    let at_eviction = counter.last_number("count ").unwrap();
    for w in [&big, &counter] {
        procfs::wait_gone(w.pid, "the evicted workload to be gone");
    }
    assert!(procfs::running(bystander.pid), "a workload not opted in runs on");
    let shown = a.ok(&["status"]);
    assert!(shown.contains("last evacuation (aws: spot instance-action terminate"), "{shown}");

    // Node B restores both from the shared bucket; they go on from where they were.
    let listed = b.json(&["list", "--workload", &counter.name, "--json"]);
    assert_eq!(listed["checkpoints"].as_array().map(Vec::len), Some(2), "rebalance and eviction: {listed}");
    counter.restored_on(&b, &b.json(&["restore", "--workload", &counter.name, "--json"]));
    counter.wait_number("count ", 0);
    let resumed = counter.numbers("count ")[0];
    assert!(
        (at_eviction..=at_eviction + 2).contains(&resumed),
        "counting resumed from {at_eviction}, not elsewhere: {resumed}"
    );
    // A second restore of the same checkpoint on B runs beside the first, from the same point.
    let mut again = counter.clone();
    again.name = format!("{}-again", counter.name);
    again.restored_on(&b, &b.json(&["restore", "--workload", &counter.name, "--as", &again.name, "--json"]));
    again.wait_number("count ", 0);
    assert_eq!(again.numbers("count ")[0], resumed, "the copy starts where the first did");
    assert!(again.pid != counter.pid && procfs::running(counter.pid) && procfs::running(again.pid));
    big.restored_on(&b, &b.json(&["restore", "--workload", &big.name, "--json"]));
    let skip = big.lines().len();
    assert_eq!(checksum(&big, skip), sum_before, "the 1 GiB of memory differs after the move");
    for pid in [big.pid, counter.pid, again.pid] {
        procfs::kill9(pid);
    }
}

/// Asks memhog.py for its checksum (SIGUSR2) and waits for the answer after line `skip`.
fn checksum(w: &stasis_tests::Workload, skip: usize) -> String {
    procfs::signal(w.pid, nix::sys::signal::Signal::SIGUSR2);
    let (_, line) = w.wait_line_after(skip, "a checksum", |l| l.starts_with("checksum "));
    line
}

#[test]
fn gcp_preemption_evicts_at_once_and_azure_events_are_acknowledged_once_durable() {
    skip_unless_ready!();
    let gcp = Imds::start(Cloud::Gcp);
    // A poll far longer than the test: GCP's answer must come from the waiting request.
    let d = Daemon::start_with(&options(&gcp, 20_000));
    let w = d.run("gcp", &python_workload("counter.py", &[]));
    d.ok(&["spot", &w.name, "--on"]);
    w.wait_number("count ", 2);
    expect_within(TIMEOUT, "the watcher to wait for a change", || (gcp.requests() >= 3).then_some(()));
    gcp.preempt(SystemTime::now(), "");
    let e = wait_evacuated_by(&d, &w.name, 30);
    assert_eq!(e["cause"], "gcp: instance preempted", "{e}");
    drop(d);

    let azure = Imds::start(Cloud::Azure);
    let d = Daemon::start_with(&options(&azure, POLL_MS));
    let w = d.run("azure", &python_workload("counter.py", &[]));
    d.ok(&["spot", &w.name, "--on"]);
    // Another VM's event is not ours.
    azure.preempt(SystemTime::now() + Duration::from_secs(30), "some-other-vm");
    let seen = azure.requests();
    expect_within(TIMEOUT, "a few more polls", || (azure.requests() >= seen + 6).then_some(()));
    assert!(procfs::running(w.pid) && evacuation_of(&d, &w.name).is_none(), "evicted for another VM's event");
    assert!(azure.acknowledged().is_empty());
    azure.preempt(SystemTime::now() + Duration::from_secs(30), AZURE_VM);
    wait_evacuated_by(&d, &w.name, 30);
    expect_within(TIMEOUT, "the event to be acknowledged", || {
        (azure.acknowledged() == ["event-2"]).then_some(())
    });
}

fn options(imds: &Imds, poll_ms: u64) -> DaemonOptions {
    DaemonOptions { args: imds.daemon_args(poll_ms), ..Default::default() }
}

/// [`wait_evacuated`] with the deadline the notice itself set.
fn wait_evacuated_by(d: &Daemon, name: &str, secs: u64) -> Value {
    wait_evacuated(d, name, Duration::from_secs(secs))
}

#[test]
fn a_notice_during_a_checkpoint_still_evicts_and_a_hung_service_is_survived() {
    skip_unless_ready!();
    let imds = Imds::start(Cloud::Aws);
    let d = Daemon::start_with(&options(&imds, POLL_MS));
    // The metadata service hangs: stasisd says so once and goes on serving.
    imds.hang(true);
    let w = d.run("busy", &python_workload("memhog.py", &["512"]));
    w.wait_line_after(0, "the workload to be ready", |l| l == "ready");
    d.ok(&["spot", &w.name, "--on"]);
    expect_within(Duration::from_secs(20), "the hang to be noticed", || {
        d.log_tail(200).contains("cannot read preemption notices").then_some(())
    });
    imds.hang(false);

    // A checkpoint is under way when the notice comes: the eviction follows it.
    let mut running = d
        .command(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    expect_within(TIMEOUT, "the checkpoint to be under way", || {
        d.log_tail(50).contains("dumping").then_some(())
    });
    imds.preempt(SystemTime::now() + Duration::from_secs(30), "");
    assert!(running.wait().unwrap().success(), "the checkpoint under way fails");
    let e = wait_evacuated_by(&d, &w.name, 30);
    procfs::wait_gone(w.pid, "the evicted workload to be gone");
    let listed = d.json(&["list", "--workload", &w.name, "--json"]);
    let ids: Vec<&str> =
        listed["checkpoints"].as_array().unwrap().iter().filter_map(|c| c["id"].as_str()).collect();
    assert_eq!(ids.len(), 2, "the checkpoint under way and the eviction: {listed}");
    assert!(ids.contains(&e["checkpoint"].as_str().unwrap()), "{e} {listed}");
    let hung = d.log_tail(400).matches("cannot read preemption notices").count();
    assert_eq!(hung, 1, "the unreachable service is reported once, not on every try");
}
