//! Runs the `stasis` binary against a fake stasisd: checks the connection, progress
//! streams, stdout discipline of `--json`, human output and errors.

mod fake_daemon;

use std::path::Path;

use fake_daemon::{json_of, stasis};
use serde_json::json;

#[tokio::test]
async fn checkpoint_json_prints_only_the_result() {
    let (out, _) = stasis("checkpoint --workload train --leave-running --json").await;
    let v = json_of(&out);
    assert_eq!((v["id"].clone(), v["left_running"].clone()), (json!("ck-1"), json!(true)));
    assert_eq!(v["stats"]["frozen_ms"], 12);
}

#[tokio::test]
async fn checkpoint_prints_a_summary_line() {
    let (out, _) = stasis("checkpoint 4242").await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(
        out.stdout,
        "checkpoint ck-1 of workload train (pid 4242): 3.0 MiB, frozen 12 ms, total 340 ms\n"
    );
}

#[tokio::test]
async fn daemon_errors_exit_1_with_the_daemon_message() {
    let (out, _) = stasis("checkpoint 13 --json").await;
    assert_eq!(out.code, Some(1));
    assert_eq!(out.stdout, "");
    assert_eq!(out.stderr, "error: process 13 does not exist.\n");
}

#[tokio::test]
async fn restore_reports_the_new_pid() {
    let (out, _) = stasis("restore ck-1").await;
    assert_eq!(out.stdout, "restored ck-1 as pid 777 in 80 ms\n");
    let (out, _) = stasis("restore --workload train --json").await;
    assert_eq!(json_of(&out)["pid"], 777);
}

#[tokio::test]
async fn restore_without_a_result_is_an_error() {
    let (out, _) = stasis("restore --workload cut").await;
    assert_eq!(out.code, Some(1));
    assert_eq!(out.stderr, "error: stasisd ended the operation without a result\n");
}

#[tokio::test]
async fn run_sends_the_command_and_an_absolute_cwd() {
    let (out, runs) = stasis("run --workload w --env A=1 --cwd sub --json -- ls -l").await;
    assert_eq!(json_of(&out), json!({ "workload": "w", "pid": 100, "log": "/logs/w.log" }));
    let cwd = std::env::current_dir().expect("current dir").join("sub");
    let [req] = runs.as_slice() else { panic!("expected one run request, got {runs:?}") };
    assert_eq!(req.argv, ["ls", "-l"]);
    assert_eq!(req.env, ["A=1"]);
    assert_eq!(Path::new(&req.cwd), cwd);
}

#[tokio::test]
async fn list_prints_a_table_or_json() {
    let (out, _) = stasis("list").await;
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{}", out.stdout);
    assert!(lines[0].starts_with("ID    WORKLOAD  PID   CREATED"), "{}", lines[0]);
    assert!(lines[1].contains("2023-11-14T22:13:20Z  3.0 MiB"), "{}", lines[1]);
    let (out, _) = stasis("list --json").await;
    assert_eq!(json_of(&out)["checkpoints"][1]["id"], "ck-2");
}

#[tokio::test]
async fn show_delete_and_status() {
    let (out, _) = stasis("show ck-1 --json").await;
    assert_eq!(json_of(&out)["command"], json!(["sleep", "100"]));
    let (out, _) = stasis("delete ck-2").await;
    assert_eq!(out.stdout, "deleted ck-2\n");
    let (out, _) = stasis("status --json").await;
    let v = json_of(&out);
    assert_eq!(
        (v["daemon_version"].clone(), v["workloads"][0]["running"].clone()),
        (json!("9.9"), json!(true))
    );
}

#[tokio::test]
async fn no_wait_answers_before_durable_and_gc_reports() {
    let (out, _) = stasis("checkpoint --workload train --no-wait --json").await;
    assert_eq!(json_of(&out)["durable"], json!(false));
    let (out, _) = stasis("checkpoint --workload train").await;
    assert!(out.stdout.contains("total 340 ms"), "{}", out.stdout);
    let (out, _) = stasis("checkpoint --workload train --no-wait").await;
    assert!(out.stdout.contains("still being stored"), "{}", out.stdout);
    let (out, _) = stasis("gc --keep-last 1 --json").await;
    let v = json_of(&out);
    assert_eq!(v["checkpoints_deleted"], json!(["ck-0", "ck-1"]));
    assert_eq!((v["packs_deleted"].clone(), v["bytes_freed"].clone()), (json!(2), json!(5 << 20)));
    let (out, _) = stasis("gc").await;
    assert_eq!(out.stdout, "deleted 3 checkpoints, 2 packs, repacked 1; freed 5.0 MiB\n");
}

#[tokio::test]
async fn idle_periods_wakes_and_their_status() {
    let (out, _) = stasis("idle train --after 90s").await;
    assert_eq!(out.stdout, "train is reclaimed after 90s idle\n", "{}", out.stderr);
    let (out, _) = stasis("idle train --off").await;
    assert_eq!(out.stdout, "train is never reclaimed\n", "{}", out.stderr);
    let (out, _) = stasis("wake nb").await;
    assert_eq!(out.stdout, "woke nb from ck-9: running as pid 77 after 180 ms, memory still arriving\n");
    let (out, _) = stasis("wake train").await;
    assert_eq!((out.code, out.stderr.trim()), (Some(1), "error: workload train is not reclaimed"));
    let (out, _) = stasis("periodic train --every 10m").await;
    assert_eq!(out.stdout, "train is checkpointed every 600s\n", "{}", out.stderr);
    let (out, _) = stasis("periodic train --off").await;
    assert_eq!(out.stdout, "train has no periodic checkpoints\n", "{}", out.stderr);
    let (out, _) = stasis("status").await;
    assert!(out.stdout.contains("  train pid 4242 running, idle 12s of 1800s: sleep"), "{}", out.stdout);
    assert!(
        out.stdout.contains(
            "    checkpointed every 192s (set: 600s; shortened to fit the notice window), last ck-2"
        ),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("    evicted on a preemption notice\n"), "{}", out.stdout);
    assert!(
        out.stdout
            .contains("    last evacuation (gcp: instance preempted): durable after 4.2s (25.8s to spare)"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("  nb pid 77 reclaimed (checkpoint ck-9; woken on use): python3"),
        "{}",
        out.stdout
    );
}

#[tokio::test]
async fn evacuate_shows_each_workload_and_fails_when_one_is_not_durable() {
    let (out, _) = stasis("spot train --on").await;
    assert_eq!(out.stdout, "train is evicted on a preemption notice\n", "{}", out.stderr);
    let (out, _) = stasis("spot ghost --off").await;
    assert_eq!((out.code, out.stderr.trim()), (Some(1), "error: unknown workload \"ghost\""));
    let (out, _) = stasis("evacuate").await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stdout.contains("train     durable after 4.2s (25.8s to spare)  ck-3"), "{}", out.stdout);
    let (out, _) = stasis("evacuate --within 10s").await;
    assert_eq!(out.code, Some(1));
    assert!(out.stdout.contains("durable after 31.3s, 1.3s late"), "{}", out.stdout);
    assert!(out.stdout.contains("failed: dumping workload db failed"), "{}", out.stdout);
    assert_eq!(out.stderr.trim(), "error: 1 of 3 workloads are not durable");
    let (out, _) = stasis("evacuate --within 10s --json").await;
    let json: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(json["workloads"][1]["durable_unix_ms"], 1_700_000_031_300u64, "{json}");
}

#[tokio::test]
async fn check_says_what_is_broken_and_fails_when_anything_is() {
    let (out, _) = stasis("check").await;
    assert_eq!(
        (out.code, out.stdout.as_str()),
        (Some(0), "checked 2 checkpoints, 3 packs\nno problems found\n")
    );
    let (out, _) = stasis("check --read-data").await;
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    assert!(
        out.stdout
            .starts_with("checked 2 checkpoints, 3 packs, 40 chunks read and verified (zstd 28, raw 12)\n"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("broken: checkpoint ck-1: chunk ab12 in pack n-1 is corrupt"),
        "{}",
        out.stdout
    );
    assert!(out.stderr.contains("1 checkpoint(s) cannot be restored whole"), "{}", out.stderr);
    // With --json too: the report on stdout, and the exit status says there are problems.
    let (out, _) = stasis("check --read-data --json").await;
    assert_eq!(out.code, Some(1));
    let report: serde_json::Value = serde_json::from_str(&out.stdout).expect("one JSON report");
    assert_eq!(report["broken"][0]["id"], "ck-1");
    assert_eq!(report["chunks_by_codec"]["zstd"], 28, "{report}");
}
