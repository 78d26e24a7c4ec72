//! A checkpoint carries the build of stasis-init its tree runs: restored on a node that lacks
//! that build (another release of stasis, another node), the build is put back in place and
//! the tree restores, its memory the same. (A binary of its own: the test removes the
//! installed build that other tests' workloads run.)

#![forbid(unsafe_code)]

use std::path::PathBuf;

use stasis_tests::{Daemon, pid_of, procfs, python_workload, skip_unless_ready};

#[test]
fn a_checkpoint_restores_where_its_stasis_init_build_is_missing() {
    skip_unless_ready!();
    let d = Daemon::start();
    let mut w = d.run("carried", &python_workload("memhog.py", &["32"]));
    w.wait_line_after(0, "the workload to be ready", |l| l == "ready");
    let exe = std::fs::read_link(format!("/proc/{}/exe", w.pid)).expect("the init's program");
    let name = exe.file_name().unwrap().to_string_lossy().into_owned();
    assert!(exe.starts_with("/var/lib/stasis/init") && name.starts_with("stasis-init-"), "{}", exe.display());
    let program = std::fs::read(&exe).unwrap();
    let before = w.memhog_checksum();

    let ck = d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    let id = ck["id"].as_str().unwrap();
    let shown = d.json(&["show", id, "--json"]);
    assert!(shown["files"].to_string().contains(&name), "the build travels with the checkpoint: {shown}");
    procfs::wait_gone(w.pid, "the evicted tree to be gone");

    // A node without that build.
    let away = PathBuf::from(format!("{}.away", exe.display()));
    std::fs::rename(&exe, &away).unwrap();
    let restored = d.json(&["restore", id, "--json"]);
    let back = std::fs::read(&exe);
    std::fs::remove_file(&away).ok();
    assert_eq!(back.ok().as_deref(), Some(program.as_slice()), "the same build, put back");
    w.restored(&restored);
    assert!(procfs::running(pid_of(&restored)));
    assert_eq!(w.memhog_checksum(), before, "the same memory");
}
