//! list, show and delete against a real store.

#![forbid(unsafe_code)]

use serde_json::Value;
use stasis_tests::{Daemon, procfs, python_workload, skip_unless_ready};

fn ids(listed: &Value) -> Vec<String> {
    listed["checkpoints"]
        .as_array()
        .unwrap_or_else(|| panic!("no checkpoints array in {listed}"))
        .iter()
        .map(|c| c["id"].as_str().expect("checkpoint id").to_owned())
        .collect()
}

#[test]
fn list_show_and_delete_checkpoints() {
    skip_unless_ready!();
    let d = Daemon::start();
    let w = d.run("counter", &python_workload("counter.py", &[]));
    let other = d.run("other", &python_workload("counter.py", &[]));
    w.wait_number("count ", 5);
    other.wait_number("count ", 5);

    let first = d.json(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"]);
    let other_ck = d.json(&["checkpoint", "--workload", &other.name, "--leave-running", "--json"]);
    let second = d.json(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"]);
    let first_id = first["id"].as_str().unwrap().to_owned();
    let second_id = second["id"].as_str().unwrap().to_owned();
    assert_ne!(first_id, second_id);

    let listed = d.json(&["list", "--workload", &w.name, "--json"]);
    assert_eq!(
        ids(&listed),
        [first_id.as_str(), second_id.as_str()],
        "two checkpoints in time order: {listed}"
    );
    let entries = listed["checkpoints"].as_array().unwrap();
    let times: Vec<u64> = entries.iter().map(|c| c["created_unix_ms"].as_u64().unwrap()).collect();
    assert!(times[0] <= times[1], "created_unix_ms out of order: {times:?}");
    for entry in entries {
        assert_eq!(entry["workload"], w.name.as_str(), "{entry}");
        assert_eq!(entry["pid"], w.pid, "{entry}");
    }
    let all = ids(&d.json(&["list", "--json"]));
    assert_eq!(all.len(), 3, "{all:?}");
    assert!(all.contains(&other_ck["id"].as_str().unwrap().to_owned()), "{all:?}");

    let shown = d.json(&["show", &first_id, "--json"]);
    assert_eq!(shown["id"], first_id.as_str(), "{shown}");
    assert_eq!(shown["workload"], w.name.as_str(), "{shown}");
    let files: Vec<&str> = shown["files"]
        .as_array()
        .unwrap_or_else(|| panic!("show has no files: {shown}"))
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for expected in
        ["inventory.img", "pstree.img", "pages-1.img", &format!("core-{}.img", procfs::inner(w.pid))]
    {
        assert!(files.contains(&expected), "show should list {expected}: {files:?}");
    }
    let pids = shown["pids"].as_array().unwrap_or_else(|| panic!("show has no pids: {shown}"));
    assert!(pids.iter().any(|p| *p == w.pid), "show's pids should include the root: {shown}");
    let second_shown = d.json(&["show", &second_id, "--json"]);
    let other_shown = d.json(&["show", other_ck["id"].as_str().unwrap(), "--json"]);

    d.ok(&["delete", &first_id]);
    let listed = d.json(&["list", "--workload", &w.name, "--json"]);
    assert_eq!(ids(&listed), [second_id.as_str()], "after deleting {first_id}: {listed}");
    assert!(
        !d.store_dir().join("manifests").join(format!("{first_id}.manifest")).exists(),
        "the deleted checkpoint's manifest is still in the store"
    );
    let err = d.cli_err(&["show", &first_id, "--json"]);
    assert!(err.contains("not found"), "show of a deleted checkpoint: {err}");
    let err = d.cli_err(&["restore", &first_id, "--json"]);
    assert!(err.contains("not found"), "restore of a deleted checkpoint: {err}");

    // The remaining checkpoints are untouched.
    assert_eq!(d.json(&["show", &second_id, "--json"]), second_shown, "after deleting {first_id}");
    let other_id = other_ck["id"].as_str().unwrap();
    assert_eq!(d.json(&["show", other_id, "--json"]), other_shown, "after deleting {first_id}");
    assert_eq!(ids(&d.json(&["list", "--json"])).len(), 2);
}
