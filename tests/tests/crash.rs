//! `kill -9` of stasisd in the middle of an upload: no partial checkpoint becomes visible, the
//! workload is not left stopped, and the next start removes the interrupted upload's data.

#![forbid(unsafe_code)]

use std::process::Stdio;
use std::time::Duration;

use stasis_tests::http_faults::{Fault, FaultyHttp, Rule};
use stasis_tests::s3::S3Server;
use stasis_tests::{Daemon, TIMEOUT, expect_within, procfs, python_workload, skip_unless_ready};

fn files_with(dir: &std::path::Path, suffix: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).filter(|n| n.ends_with(suffix)).collect()
}

#[test]
fn a_crash_mid_upload_leaves_no_checkpoint_and_the_next_start_cleans_up() {
    skip_unless_ready!();
    let mut d = Daemon::start();
    // 512 MiB of random memory: its upload takes long enough to be interrupted.
    let w = d.run("big", &python_workload("memhog.py", &["512"]));
    expect_within(Duration::from_secs(60), "the workload to be ready", || {
        w.lines().iter().any(|l| l == "ready").then_some(())
    });
    let mut checkpoint = d
        .command(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting the checkpoint");
    let inflight = d.dir().join("state/inflight");
    let packs = d.store_dir().join("packs");
    // Wait until the upload is under way (a marker and a first pack), then crash stasisd.
    let id = expect_within(TIMEOUT, "an upload in flight", || {
        let ids = files_with(&inflight, "");
        (!ids.is_empty() && !files_with(&packs, ".pack").is_empty()).then(|| ids[0].clone())
    });
    d.kill9_and_restart();
    let _ = checkpoint.wait();

    assert!(
        !d.store_dir().join("manifests").join(format!("{id}.manifest")).exists(),
        "the interrupted checkpoint {id} became visible"
    );
    let listed = d.json(&["list", "--json"]);
    assert_eq!(listed["checkpoints"].as_array().map(Vec::len), Some(0), "{listed}");
    assert!(files_with(&inflight, "").is_empty(), "the in-flight marker was not cleared");
    assert!(files_with(&packs, ".pack").is_empty(), "the interrupted upload's packs were not removed");
    assert!(files_with(&packs, ".idx").is_empty(), "the interrupted upload's pack indexes were not removed");
    assert!(
        procfs::running(w.pid),
        "the workload was left stopped or killed: {:?}",
        procfs::proc_state(w.pid)
    );

    // The restarted daemon still works: a checkpoint of the same workload commits.
    d.json(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"]);
}

#[test]
fn sigterm_lets_a_running_checkpoint_finish() {
    skip_unless_ready!();
    let mut d = Daemon::start();
    let w = d.run("big", &python_workload("memhog.py", &["512"]));
    expect_within(Duration::from_secs(60), "the workload to be ready", || {
        w.lines().iter().any(|l| l == "ready").then_some(())
    });
    let checkpoint = d
        .command(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the checkpoint");
    let inflight = d.dir().join("state/inflight");
    expect_within(TIMEOUT, "the checkpoint to be under way", || {
        (!files_with(&inflight, "").is_empty()).then_some(())
    });
    let status = d.stop().expect("stasisd exits after SIGTERM");
    assert!(status.success(), "stasisd exited with {status}");
    let out = checkpoint.wait_with_output().unwrap();
    assert!(out.status.success(), "the checkpoint was cut short: {}", String::from_utf8_lossy(&out.stderr));
    let result: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let id = result["id"].as_str().unwrap();
    assert!(d.store_dir().join("manifests").join(format!("{id}.manifest")).exists(), "{result}");
    assert!(procfs::running(w.pid), "the workload runs on after stasisd stopped");
}

#[test]
fn a_crash_mid_eviction_gives_the_held_workload_back_at_the_next_start() {
    skip_unless_ready!();
    // An eviction's pages are stored while CRIU dumps; then the stopped tree waits for the
    // commit. The store (S3 through a relay) holds the manifest back, so stasisd dies then.
    let Some(s3) = S3Server::start() else { return };
    let relay = FaultyHttp::start(s3.port);
    relay.set(Some(Rule { method: "PUT", path: "/manifests/", fault: Fault::Slow(Duration::from_secs(60)) }));
    let mut d = Daemon::start_with(&s3.daemon_options_at(relay.port, "held", &[]));
    // A process of the test's own, checkpointed by pid: its parent stays alive, so stasisd's
    // death does not orphan its process group (which would make the kernel continue it).
    // It leads a session of its own (setsid(1) execs in place, keeping the pid): the test
    // runner's session leader may sit outside this pid namespace (as on CI), where CRIU cannot
    // name it.
    let out = d.dir().join("memhog.out");
    let child = std::process::Command::new("setsid")
        .arg(stasis_tests::python())
        .arg(stasis_tests::workload_script("memhog.py"))
        .arg("512")
        // Its own stdio: whatever the test runner's are (a socket to a CI agent, say), CRIU
        // may be unable to dump them.
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("output file"))
        .stderr(Stdio::null())
        .spawn()
        .expect("starting memhog.py");
    // Killed and reaped however the test ends (a failure would leave it stopped otherwise).
    let child = KillOnDrop(child);
    let pid = child.0.id() as i32;
    expect_within(Duration::from_secs(60), "the workload to be ready", || {
        std::fs::read_to_string(&out).ok()?.lines().any(|l| l == "ready").then_some(())
    });
    let errors = d.dir().join("checkpoint.err");
    let mut checkpoint = d
        .command(&["checkpoint", &pid.to_string(), "--json"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&errors).expect("error file"))
        .spawn()
        .expect("starting the eviction");
    let inflight = d.dir().join("state/inflight");
    // CRIU dumped the tree and left it stopped for the eviction; stasisd dies holding it.
    expect_within(TIMEOUT, "the dumped tree held stopped, its checkpoint in flight", || {
        if let Ok(Some(status)) = checkpoint.try_wait() {
            panic!(
                "the eviction ended early ({status}): {}",
                std::fs::read_to_string(&errors).unwrap_or_default()
            );
        }
        (!files_with(&inflight, "").is_empty() && procfs::proc_state(pid) == Some('T')).then_some(())
    });
    d.kill9_and_restart();
    let _ = checkpoint.wait();

    expect_within(TIMEOUT, "the held workload to be given back", || {
        (procfs::proc_state(pid).is_some_and(|s| s != 'T')).then_some(())
    });
    assert!(procfs::running(pid), "state of the workload: {:?}", procfs::proc_state(pid));
    let listed = d.json(&["list", "--json"]);
    assert_eq!(listed["checkpoints"].as_array().map(Vec::len), Some(0), "{listed}");
    assert!(files_with(&d.dir().join("state/held"), "").is_empty(), "the record was not cleared");
    // And it can be evicted for real now.
    relay.set(None);
    d.json(&["checkpoint", &pid.to_string(), "--json"]);
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_restore_left_under_way_by_a_crash_is_ended_at_the_next_start() {
    skip_unless_ready!();
    let mut d = Daemon::start();
    // Stand-ins for the CRIUs of a crashed stasisd, each working in its images directory: one
    // restoring (which can no longer finish: the next start ends it if it does not end by
    // itself), one dumping (left to give its tree back by itself: not touched).
    let work = d.dir().join("state/work");
    let left_in = |dir: &str| {
        std::fs::create_dir_all(work.join(dir)).expect("a work directory");
        let child = std::process::Command::new("sleep").arg("600").current_dir(work.join(dir)).spawn();
        KillOnDrop(child.expect("starting sleep"))
    };
    let (mut restoring, mut dumping) = (left_in("restore-0badc0de"), left_in("20261128-120000-0badc0"));
    d.kill9_and_restart();
    expect_within(TIMEOUT, "the restore left under way to be ended", || {
        restoring.0.try_wait().expect("waiting for the restore's stand-in").map(|_| ())
    });
    assert!(dumping.0.try_wait().expect("the dump's stand-in").is_none(), "a dump's CRIU was killed");
    assert!(!work.join("restore-0badc0de").exists(), "the restore's work directory stays");
    assert!(d.log_tail(50).contains("did not end by itself"), "{}", d.log_tail(50));
}

#[test]
fn a_crash_at_a_restores_pre_resume_leaves_no_criu_behind() {
    skip_unless_ready!();
    // A tree with a pid namespace of its own (stasis-init and the command) and a CRIU that
    // loses stasisd at pre-resume: CRIU then kills the tree and can deadlock with it for good
    // (the init waits for a child CRIU still traces; CRIU waits for the init). A later start
    // ends such a CRIU.
    let mut d = Daemon::start();
    let mut w = d.run("hog", &python_workload("memhog.py", &["256"]));
    w.wait_line_after(0, "`ready`", |l| l == "ready");
    let sum = w.memhog_checksum();
    d.json(&["checkpoint", "--workload", &w.name, "--json"]);
    let scratch = || -> Vec<std::path::PathBuf> {
        let shm = std::fs::read_dir("/dev/shm").into_iter().flatten().flatten().map(|e| e.path());
        let work = std::fs::read_dir(d.dir().join("state/work")).into_iter().flatten().flatten();
        let dirs = shm.filter(|p| p.to_string_lossy().contains("stasis-restore-"));
        dirs.chain(work.map(|e| e.path())).collect()
    };
    let before = scratch();
    let mut restore = d.command(&["restore", "--workload", &w.name]).stdout(Stdio::null()).spawn().unwrap();
    // An eager restore waits at pre-resume until every page is in (256 MiB: long enough).
    let dir = expect_within(TIMEOUT, "the restore's CRIU at pre-resume", || {
        scratch().into_iter().filter(|p| !before.contains(p)).find(|dir| {
            let log = std::fs::read_to_string(dir.join("criu.log")).unwrap_or_default();
            log.contains("Running pre-resume scripts")
        })
    });
    d.kill9_and_restart();
    let _ = restore.wait();
    // The restarted stasisd dies too, before that CRIU's grace is over: having removed the
    // directory, it leaves the next start only the CRIU's working directory's name to go by.
    d.kill9_and_restart();
    // That CRIU works in the restore's directory (removed by the restart: "... (deleted)").
    let in_dir = |pid: &i32| {
        std::fs::read_link(format!("/proc/{pid}/cwd"))
            .is_ok_and(|cwd| cwd.to_string_lossy().starts_with(&*dir.to_string_lossy()))
    };
    expect_within(TIMEOUT, "no CRIU of the killed stasisd left", || {
        (!procfs::orphaned_criu().iter().any(in_dir)).then_some(())
    });
    // Nor what it had mounted in its directory (its cgroup yard: the host's cgroup hierarchies
    // under a tmpfs), nor the directory.
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("the mount table");
    let left: Vec<&str> = mountinfo.lines().filter(|l| l.contains(&*dir.to_string_lossy())).collect();
    assert!(left.is_empty(), "mounts left in the restore's directory: {left:#?}");
    assert!(!dir.exists(), "the restore's directory {} is left", dir.display());
    // And the checkpoint restores.
    w.restored(&d.json(&["restore", "--workload", &w.name, "--json"]));
    assert_eq!(w.memhog_checksum(), sum, "the memory of the restored workload");
}
