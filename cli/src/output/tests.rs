//! The JSON the CLI prints is what scripts and the e2e tests read: these pin its field names,
//! nesting and value types, as derived from the API messages.

use serde_json::{Value, json};
use stasis_proto::stasis::store::v1::CheckpointStats;
use stasis_proto::stasis::v1::{
    CheckpointInfo, CheckpointResult, GcResponse, ListResponse, RestoreResult, RestoreStats, RunResponse,
    StatusResponse, WorkloadStatus,
};

use super::*;

/// `message` as the CLI prints it, parsed back.
fn json_of(message: &impl serde::Serialize) -> Value {
    serde_json::to_string(message).and_then(|text| serde_json::from_str(&text)).expect("JSON round trip")
}

fn stats() -> CheckpointStats {
    CheckpointStats {
        frozen_ms: 12,
        total_ms: 340,
        bytes_total: 5 << 20,
        dump_ms: 200,
        store_ms: 120,
        durable_ms: 330,
        bytes_uploaded: 1 << 20,
        chunks_total: 80,
        chunks_new: 16,
        chunks_zero: 4,
        gpu_lock_ms: 1,
        gpu_checkpoint_ms: 900,
        gpu_restore_ms: 450,
        gpu_bytes: 1 << 30,
        bytes_unchanged: 3 << 20,
        bytes_from_tree: 1 << 16,
        bytes_in_part: 1 << 15,
    }
}

fn info() -> CheckpointInfo {
    CheckpointInfo {
        id: "ck-1".into(),
        workload: "train".into(),
        pid: 4242,
        created_unix_ms: 1_700_000_000_123,
        bytes_total: 5 << 20,
        node: "node-a".into(),
        kernel: "6.8.0".into(),
        criu_version: "4.1".into(),
        command: vec!["python".into(), "-u".into()],
        pids: vec![4242, 4243],
        files: vec!["pages-1.img".into()],
        stats: Some(stats()),
        criu_options: vec!["tcp_established".into()],
        sockets: vec!["tcp listen 127.0.0.1:8080, pid 4242 fd 3".into()],
        imported_from: String::new(),
    }
}

#[test]
fn run_response_renames_log_path_to_log() {
    let r = RunResponse { workload: "w".into(), pid: 7, log_path: "/var/log/w.log".into() };
    assert_eq!(json_of(&r), json!({ "workload": "w", "pid": 7, "log": "/var/log/w.log" }));
}

#[test]
fn checkpoint_result_nests_its_stats() {
    let r = CheckpointResult {
        id: "ck-1".into(),
        workload: "train".into(),
        pid: 4242,
        stats: Some(stats()),
        left_running: true,
        durable: true,
    };
    assert_eq!(
        json_of(&r),
        json!({
            "id": "ck-1",
            "workload": "train",
            "pid": 4242,
            "left_running": true,
            "durable": true,
            "stats": {
                "frozen_ms": 12,
                "total_ms": 340,
                "bytes_total": 5 << 20,
                "dump_ms": 200,
                "store_ms": 120,
                "durable_ms": 330,
                "bytes_uploaded": 1 << 20,
                "chunks_total": 80,
                "chunks_new": 16,
                "chunks_zero": 4,
                "gpu_lock_ms": 1,
                "gpu_checkpoint_ms": 900,
                "gpu_restore_ms": 450,
                "gpu_bytes": 1 << 30, "bytes_unchanged": 3 << 20, "bytes_from_tree": 1 << 16,
                "bytes_in_part": 1 << 15,
            },
        })
    );
}

#[test]
fn missing_stats_are_null() {
    let r =
        RestoreResult { id: "ck-1".into(), workload: "train".into(), pid: 9, stats: None, warnings: vec![] };
    assert_eq!(json_of(&r)["stats"], Value::Null);
}

#[test]
fn restore_result_nests_its_stats() {
    let r = RestoreResult {
        id: "ck-1".into(),
        workload: "train".into(),
        pid: 9,
        stats: Some(RestoreStats {
            restore_ms: 80,
            fetch_ms: 30,
            criu_ms: 45,
            bytes_fetched: 1024,
            gpu_restore_ms: 0,
            first_run_ms: 20,
            resident_ms: 75,
            lazy: true,
        }),
        warnings: vec!["peer gone".into()],
    };
    assert_eq!(
        json_of(&r),
        json!({
            "id": "ck-1",
            "workload": "train",
            "pid": 9,
            "warnings": ["peer gone"],
            "stats": {
                "restore_ms": 80, "fetch_ms": 30, "criu_ms": 45, "bytes_fetched": 1024, "gpu_restore_ms": 0,
                "lazy": true, "first_run_ms": 20, "resident_ms": 75,
            },
        })
    );
}

#[test]
fn checkpoint_info_has_every_field() {
    let v = json_of(&info());
    let Some(object) = v.as_object() else {
        panic!("not an object: {v}");
    };
    let mut keys: Vec<&str> = object.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "bytes_total",
            "command",
            "created_unix_ms",
            "criu_options",
            "criu_version",
            "files",
            "id",
            "imported_from",
            "kernel",
            "node",
            "pid",
            "pids",
            "sockets",
            "stats",
            "workload",
        ]
    );
    assert_eq!(v["created_unix_ms"], 1_700_000_000_123_u64);
    assert_eq!(v["command"], json!(["python", "-u"]));
    assert_eq!(v["pids"], json!([4242, 4243]));
    assert_eq!(v["criu_options"], json!(["tcp_established"]));
    assert_eq!(v["sockets"], json!(["tcp listen 127.0.0.1:8080, pid 4242 fd 3"]));
    assert_eq!(v["stats"]["frozen_ms"], 12);
}

#[test]
fn list_response_wraps_checkpoint_infos() {
    let l = ListResponse { checkpoints: vec![info(), info()], unreadable: vec!["ck-9: corrupted".into()] };
    let v = json_of(&l);
    assert_eq!(v["checkpoints"].as_array().map(Vec::len), Some(2));
    assert_eq!(v["checkpoints"][1], json_of(&info()));
    assert_eq!(v["unreadable"], json!(["ck-9: corrupted"]));
    assert_eq!(json_of(&ListResponse::default()), json!({ "checkpoints": [], "unreadable": [] }));
}

#[test]
fn status_response_lists_workloads() {
    let s = StatusResponse {
        daemon_version: "0.1.0".into(),
        criu_version: "4.1".into(),
        criu_path: "/usr/sbin/criu".into(),
        kernel: "6.8.0".into(),
        gpu_support: "none".into(),
        store_url: "file:///var/lib/stasis/store".into(),
        state_dir: "/var/lib/stasis".into(),
        socket_support: "supported".into(),
        network_lock: "nftables".into(),
        memory_tracking: "off (no soft-dirty)".into(),
        compression: "zstd".into(),
        notices: "off".into(),
        workloads: vec![WorkloadStatus {
            name: "train".into(),
            pid: 4242,
            running: false,
            command: vec!["sleep".into(), "100".into()],
            last_error: "the store did not deliver memory".into(),
            state: "reclaimed".into(),
            idle_ms: 0,
            idle_after_ms: 30_000,
            reclaimed_checkpoint: "20261123-120000-abcdef".into(),
            checkpoint_every_ms: 0,
            last_checkpoint: "20261123-120000-abcdef".into(),
            spot: false,
            evacuation: None,
            fitted_every_ms: 0,
            log_path: "/var/lib/stasis/logs/train.log".into(),
            container: String::new(),
        }],
    };
    assert_eq!(
        json_of(&s),
        json!({
            "daemon_version": "0.1.0",
            "criu_version": "4.1",
            "criu_path": "/usr/sbin/criu",
            "kernel": "6.8.0",
            "gpu_support": "none",
            "socket_support": "supported",
            "network_lock": "nftables",
            "memory_tracking": "off (no soft-dirty)",
            "compression": "zstd",
            "notices": "off",
            "store_url": "file:///var/lib/stasis/store",
            "state_dir": "/var/lib/stasis",
            "workloads": [
                {
                    "name": "train", "pid": 4242, "running": false, "command": ["sleep", "100"], "container": "",
                    "last_error": "the store did not deliver memory", "state": "reclaimed", "idle_ms": 0,
                    "idle_after_ms": 30_000, "reclaimed_checkpoint": "20261123-120000-abcdef",
                    "checkpoint_every_ms": 0, "last_checkpoint": "20261123-120000-abcdef",
                    "spot": false, "evacuation": null, "fitted_every_ms": 0,
                    "log_path": "/var/lib/stasis/logs/train.log",
                },
            ],
        })
    );
}

#[test]
fn gc_response_keeps_64_bit_counts_as_exact_numbers() {
    let r = GcResponse {
        checkpoints_deleted: vec!["ck-1".into()],
        packs_deleted: 3,
        packs_repacked: 0,
        bytes_freed: u64::MAX,
        damaged_packs: vec!["n-1".into()],
    };
    assert_eq!(
        json_of(&r),
        json!({
            "checkpoints_deleted": ["ck-1"], "packs_deleted": 3, "packs_repacked": 0, "bytes_freed": u64::MAX,
            "damaged_packs": ["n-1"],
        })
    );
}

#[test]
fn utc_formats_epoch_milliseconds() {
    assert_eq!(utc(0), "1970-01-01T00:00:00Z");
    assert_eq!(utc(1_700_000_000_123), "2023-11-14T22:13:20Z");
    // A leap day, and the last second of a leap year.
    assert_eq!(utc(951_782_400_000), "2000-02-29T00:00:00Z");
    assert_eq!(utc(1_735_689_599_999), "2024-12-31T23:59:59Z");
    // Past jiff's range, the end of it.
    assert!(utc(u64::MAX).starts_with("9999-12-"));
}

#[test]
fn table_aligns_columns() {
    let rows = [["ck-1".to_owned(), "a".to_owned()], ["c".to_owned(), "long".to_owned()]];
    assert_eq!(table(["ID", "NAME"], rows), "ID    NAME\nck-1  a\nc     long");
}
