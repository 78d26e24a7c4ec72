//! Who may act: with `--socket-group`, a real unprivileged user in that group (created by the
//! test) may use stasisd for its own processes and checkpoints only; a user outside the group
//! cannot connect at all.

#![forbid(unsafe_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;
use stasis_tests::preload::{loaders, marker_library};
use stasis_tests::{
    Daemon, DaemonOptions, TIMEOUT, bin, expect_within, pid_of, procfs, python, skip_unless_ready,
};

/// A group and a user in it, removed again when dropped.
struct TestUser {
    name: String,
    group: String,
    uid: u32,
}

impl TestUser {
    fn create() -> TestUser {
        let tag = format!("{:06x}", rand_tag());
        let (name, group) = (format!("stasis-u{tag}"), format!("stasis-g{tag}"));
        run_ok(Command::new("groupadd").arg(&group));
        // Made before the user, so that a failure below still removes the group.
        let mut user = TestUser { name: name.clone(), group: group.clone(), uid: 0 };
        run_ok(Command::new("useradd").args(["-M", "-N", "-g", &group, "-s", "/usr/sbin/nologin", &name]));
        let id = run_ok(Command::new("id").args(["-u", &name]));
        user.uid = String::from_utf8_lossy(&id.stdout).trim().parse().expect("a numeric uid");
        user
    }
}

impl Drop for TestUser {
    fn drop(&mut self) {
        let _ = Command::new("pkill").args(["-9", "-u", &self.name]).status();
        let _ = Command::new("userdel").arg(&self.name).status();
        let _ = Command::new("groupdel").arg(&self.group).status();
    }
}

fn rand_tag() -> u32 {
    std::process::id()
        ^ (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos())
            & 0xff_ffff
}

fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

/// `stasis ARGS` run as `user` (uid and group, no other groups), from a copy of the CLI the
/// user can reach.
fn as_user(d: &Daemon, cli: &PathBuf, user: &str, group: &str, args: &[&str]) -> Output {
    let socket = d.dir().join("stasisd.sock");
    Command::new("setpriv")
        .args(["--reuid", user, "--regid", group, "--clear-groups", "--"])
        .arg(cli)
        .arg("--socket")
        .arg(&socket)
        .args(args)
        .current_dir("/")
        .output()
        .expect("running stasis as another user")
}

fn json(out: &Output) -> Value {
    assert!(out.status.success(), "failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", out.stdout))
}

fn refused(out: &Output, what: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{what} should be refused");
    assert!(stderr.contains("not yours") || stderr.contains("root's alone"), "{what}: {stderr}");
    stderr
}

/// A stasisd whose socket `user`'s group may use (with `env` in its environment, and `store`
/// when given), and a copy of the CLI the user can run.
fn daemon_for(user: &TestUser, env: Vec<(String, String)>, store: Option<String>) -> (Daemon, PathBuf) {
    let d = Daemon::start_with(&DaemonOptions {
        args: vec!["--socket-group".into(), user.group.clone()],
        env,
        store,
    });
    std::fs::set_permissions(d.dir(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let cli = d.dir().join("stasis-cli");
    std::fs::copy(bin("stasis"), &cli).unwrap();
    std::fs::set_permissions(&cli, std::fs::Permissions::from_mode(0o755)).unwrap();
    (d, cli)
}

#[test]
fn a_group_member_acts_only_on_its_own_and_others_cannot_connect() {
    skip_unless_ready!();
    let user = TestUser::create();
    let (name, group) = (user.name.as_str(), user.group.as_str());
    let (d, cli) = daemon_for(&user, Vec::new(), None);
    let sleeper = [
        python(),
        "-c".into(),
        "import os, time\nprint('uid', os.getuid(), flush=True)\ntime.sleep(600)".into(),
    ];

    // Root's workload and checkpoint.
    let theirs = d.run("rootw", &sleeper);
    let root_ck = d.json(&["checkpoint", "--workload", &theirs.name, "--leave-running", "--json"]);
    let root_id = root_ck["id"].as_str().unwrap();

    let status = json(&as_user(&d, &cli, name, group, &["status", "--json"]));
    assert_eq!(
        status["workloads"].as_array().map(Vec::len),
        Some(0),
        "root's workloads are not listed: {status}"
    );
    refused(
        &as_user(&d, &cli, name, group, &["checkpoint", "--workload", &theirs.name]),
        "checkpoint of root's workload",
    );
    refused(
        &as_user(&d, &cli, name, group, &["checkpoint", &theirs.pid.to_string()]),
        "checkpoint of root's pid",
    );
    assert_eq!(
        procfs::proc_state(theirs.pid).map(|s| s != 'T'),
        Some(true),
        "root's workload runs untouched"
    );
    let listed = json(&as_user(&d, &cli, name, group, &["list", "--json"]));
    assert_eq!(listed["checkpoints"].as_array().map(Vec::len), Some(0), "{listed}");
    for args in [&["show", root_id][..], &["delete", root_id], &["restore", root_id], &["gc"]] {
        refused(&as_user(&d, &cli, name, group, args), &args.join(" "));
    }
    assert!(d.json(&["show", root_id, "--json"])["id"] == root_id, "root's checkpoint is still there");

    // Its own workload runs as itself, and it may evict and restore it.
    let mut args = vec!["run", "--workload", "mine", "--json", "--"];
    args.extend(sleeper.iter().map(String::as_str));
    let pid = pid_of(&json(&as_user(&d, &cli, name, group, &args)));
    let uid_of = |pid: i32| {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .map(|u| u.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
    };
    let mine = user.uid.to_string();
    // stasis-init forks the command as root and drops to the user before exec: wait for that
    // (a workload left running as root times out here).
    let command = procfs::command_of(pid);
    expect_within(TIMEOUT, "the workload to run as the user", || {
        (uid_of(command) == Some(vec![mine.clone(); 4])).then_some(())
    });
    // Someone outside the group cannot even connect.
    let out = as_user(&d, &cli, "nobody", "nogroup", &["status"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.to_lowercase().contains("permission denied"), "{stderr}");

    if !has_cap_sys_resource() {
        // CRIU reads a dumped process's rlimits with prlimit(2), which a root without
        // CAP_SYS_RESOURCE (this project's VMs) may not do for another uid's process.
        eprintln!("skipping the user's own checkpoint and restore: no CAP_SYS_RESOURCE here");
        return;
    }
    let ck = json(&as_user(&d, &cli, name, group, &["checkpoint", "--workload", "mine", "--json"]));
    procfs::wait_gone(pid, "the evicted workload to be gone");
    let listed = json(&as_user(&d, &cli, name, group, &["list", "--json"]));
    assert_eq!(listed["checkpoints"][0]["id"], ck["id"], "its own checkpoint is listed: {listed}");
    let restored = json(&as_user(&d, &cli, name, group, &["restore", "--workload", "mine", "--json"]));
    let restored = procfs::command_of(pid_of(&restored));
    assert_eq!(uid_of(restored), Some(vec![mine; 4]), "restored as the user, not as root");
}

/// Whether this process has CAP_SYS_RESOURCE (bit 24 of its effective set).
fn has_cap_sys_resource() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let eff = status.lines().find_map(|l| l.strip_prefix("CapEff:")).map(str::trim).unwrap_or("0");
    u64::from_str_radix(eff, 16).is_ok_and(|caps| caps & (1 << 24) != 0)
}

#[test]
fn nothing_a_group_member_chooses_runs_as_root() {
    skip_unless_ready!();
    let user = TestUser::create();
    let (name, group) = (user.name.as_str(), user.group.as_str());
    let secret = format!("s{:06x}", rand_tag());
    let (d, cli) = daemon_for(&user, vec![("STASIS_TEST_SECRET".into(), secret.clone())], None);
    // A directory anyone may write the marker into and read the library from.
    let shared = tempfile::Builder::new().prefix("stasis-preload").tempdir_in("/tmp").unwrap();
    std::fs::set_permissions(shared.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let marker = shared.path().join("loaded-by");
    let library = marker_library(shared.path(), &marker);

    for host_pids in [false, true] {
        let _ = std::fs::remove_file(&marker);
        let workload = format!("env{}", u8::from(host_pids));
        let preload = format!("LD_PRELOAD={}", library.display());
        let mut args = vec!["run", "--workload", &workload, "--env", &preload, "--json"];
        args.push(if host_pids { "--host-pids" } else { "--own-pids" });
        args.extend(["--", "/bin/sh", "-c", "env; echo done; sleep 60"]);
        let started = json(&as_user(&d, &cli, name, group, &args));
        let log = PathBuf::from(started["log"].as_str().expect("the workload's log"));
        let text = expect_within(TIMEOUT, "the workload to print its environment", || {
            std::fs::read_to_string(&log).ok().filter(|t| t.contains("done"))
        });
        let loaded = loaders(&marker);
        let what = if host_pids { "with host pids" } else { "under stasis-init" };
        assert!(
            loaded.iter().any(|l| l.euid == user.uid),
            "{what}: the workload loads it as itself: {loaded:?}"
        );
        assert!(
            loaded.iter().all(|l| l.euid != 0),
            "{what}: the caller's LD_PRELOAD ran as root: {loaded:?}"
        );
        assert!(!text.contains(&secret), "{what}: stasisd's environment reached the workload:\n{text}");
        assert!(
            text.contains(&format!("USER={name}")),
            "{what}: the workload's environment names its user:\n{text}"
        );
    }

    // A directory the caller may not enter is not entered for it by root.
    let private = tempfile::Builder::new().prefix("stasis-private").tempdir_in("/tmp").unwrap();
    std::fs::set_permissions(private.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let cwd = private.path().to_str().unwrap();
    let out = as_user(
        &d,
        &cli,
        name,
        group,
        &["run", "--workload", "cwd", "--host-pids", "--cwd", cwd, "--", "/bin/sleep", "60"],
    );
    assert!(!out.status.success(), "a run in {cwd} as the user should fail to start");
    let out = as_user(
        &d,
        &cli,
        name,
        group,
        &["run", "--workload", "cwd2", "--json", "--cwd", cwd, "--own-pids", "--", "/bin/sleep", "60"],
    );
    if out.status.success() {
        let log = PathBuf::from(json(&out)["log"].as_str().expect("the workload's log").to_string());
        expect_within(TIMEOUT, "stasis-init to say why the command did not start", || {
            std::fs::read_to_string(&log).ok().filter(|t| t.contains("ermission denied"))
        });
    }
    let inside: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read_link(e.path().join("cwd")).is_ok_and(|c| c == private.path()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(inside.is_empty(), "processes run in the private directory: {inside:?}");
}

#[test]
fn the_store_and_the_state_are_roots_alone() {
    skip_unless_ready!();
    let user = TestUser::create();
    // A store directory made beforehand with the usual mode, in a directory anyone may enter.
    let parent = tempfile::Builder::new().prefix("stasis-store").tempdir_in("/tmp").unwrap();
    std::fs::set_permissions(parent.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let store = parent.path().join("store");
    std::fs::create_dir(&store).unwrap();
    std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (d, _cli) = daemon_for(&user, Vec::new(), Some(format!("file://{}", store.display())));
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(&store), 0o700, "the store's looser mode is tightened at start");
    assert_eq!(mode(&d.dir().join("state")), 0o700, "the state directory");

    // Root's checkpoint is in the store; the user can neither list nor read any of it.
    let w = d
        .run("secretw", &[python(), "-c".into(), "import time\nx = 'marker' * 1000\ntime.sleep(600)".into()]);
    d.json(&["checkpoint", "--workload", &w.name, "--leave-running", "--json"]);
    for dir in [store.clone(), d.dir().join("state")] {
        let out = Command::new("setpriv")
            .args(["--reuid", &user.name, "--regid", &user.group, "--clear-groups", "--", "sh", "-c"])
            .arg("ls \"$1\" && find \"$1\" -type f -exec cat {} +")
            .arg("sh")
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            !out.status.success() && out.stdout.is_empty(),
            "{} is open to another user: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stdout).chars().take(200).collect::<String>()
        );
    }
}

#[test]
fn a_group_member_cannot_take_a_containers_name() {
    skip_unless_ready!();
    let user = TestUser::create();
    let (d, cli) = daemon_for(&user, Vec::new(), None);
    let out = as_user(
        &d,
        &cli,
        &user.name,
        &user.group,
        &["run", "--workload", "k8s.ns.statefulset.db.0.main", "--", "/bin/sleep", "60"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a member took a container's name");
    assert!(stderr.contains("Kubernetes container's"), "{stderr}");
    // Root may (the node agent registers containers as root).
    d.json(&["run", "--workload", "k8s.ns.statefulset.db.0.main", "--json", "--", "/bin/sleep", "60"]);
}

/// A restore hands a process no file its own user may not open: CRIU reopens files by path as
/// root and checks only their size and mode, so a file replaced since the checkpoint by one of
/// root's with the same size and mode must not reach the restored process. The job opens
/// files as nobody (its filesystem ids) while its other ids stay root's: this VM's root lacks
/// CAP_SYS_RESOURCE, without which CRIU cannot checkpoint another user's process at all.
#[test]
fn a_restored_process_gets_no_file_its_user_may_not_open() {
    skip_unless_ready!();
    let d = Daemon::start();
    let dir = tempfile::Builder::new().prefix("stasis-owned").tempdir_in("/var/tmp").unwrap();
    let file = dir.path().join("notes");
    // `notes` as nobody's file (mode 0600), or as root's of the same size and mode.
    let put = |text: &str, owner: u32| {
        let staged = dir.path().join("staged");
        std::fs::write(&staged, text).unwrap();
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::chown(&staged, Some(owner), Some(owner)).unwrap();
        std::fs::rename(&staged, &file).unwrap();
    };
    put("nobody's own notes\n", 65534);
    let script = format!(
        "import ctypes, time\nf = open('{}')\nlibc = ctypes.CDLL(None)\nlibc.setfsgid(65534)\n\
         libc.setfsuid(65534)\nprint('ready', flush=True)\ntime.sleep(600)",
        file.display()
    );
    let mut job = d.run("owned", &[python(), "-c".into(), script]);
    expect_within(TIMEOUT, "the job to hold the file", || (!holders(&file).is_empty()).then_some(()));
    let ck = d.json(&["checkpoint", "--workload", &job.name, "--json"]);
    procfs::wait_gone(job.pid, "the evicted job to be gone");

    // The path now leads to a file of root's: the restore is refused before the job runs.
    put("root's secret notes", 0);
    let err = d.cli_err(&["restore", "--workload", &job.name, "--json"]);
    assert!(err.contains("may not open") && err.contains("notes"), "{err}\n{}", d.log_tail(30));
    assert_eq!(holders(&file), Vec::<i32>::new(), "a restored process holds root's file");

    // With nobody's file back, the same checkpoint restores.
    put("nobody's own notes\n", 65534);
    let restored = d.json(&["restore", "--workload", &job.name, "--json"]);
    assert_eq!(restored["id"], ck["id"], "{restored}");
    job.restored(&restored);
    let command = procfs::command_of(job.pid);
    assert_eq!(holders(&file), vec![command], "it holds the file again");
}

/// The processes holding `file` open.
fn holders(file: &std::path::Path) -> Vec<i32> {
    let pids =
        std::fs::read_dir("/proc").unwrap().flatten().filter_map(|e| e.file_name().to_str()?.parse().ok());
    pids.filter(|pid: &i32| {
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).into_iter().flatten().flatten();
        fds.into_iter().any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == file))
    })
    .collect()
}
