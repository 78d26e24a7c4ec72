//! A container as the host sees it: its init's namespaces and cgroups, and the few things a
//! CRIU that runs inside it needs there (a writable /tmp, free pids).

use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use super::proc::{self, ProcStat};
use super::reaper::{ExitKind, Reaper};

/// How long a restore waits for processes that hold pids its tree needs to exit.
const TAKEN_PID_WAIT: Duration = Duration::from_secs(5);

/// The `cgroup.procs` file, in every hierarchy mounted here, of the cgroups `pid` is in: what
/// a process writes itself into to join them all (one file on a pure v2 host, one per
/// hierarchy on a hybrid one).
pub fn cgroup_procs_files(pid: i32) -> io::Result<Vec<PathBuf>> {
    let memberships = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo")?;
    let files = memberships
        .lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            let mount = hierarchy_mount(&mounts, controllers)?;
            Some(mount.join(path.trim_start_matches('/')).join("cgroup.procs"))
        })
        .collect();
    Ok(files)
}

/// Where the hierarchy of `controllers` (as /proc/PID/cgroup names them: "" for v2,
/// "cpu,cpuacct", "name=systemd") is mounted, from mountinfo `text`.
fn hierarchy_mount(text: &str, controllers: &str) -> Option<PathBuf> {
    text.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mut right = right.split_whitespace();
        let (fstype, _source, options) = (right.next()?, right.next()?, right.next()?);
        let point = crate::mounts::mount_point(left)?;
        let matches = match controllers {
            "" => fstype == "cgroup2",
            wanted => fstype == "cgroup" && wanted.split(',').all(|c| options.split(',').any(|o| o == c)),
        };
        matches.then_some(point)
    })
}

/// Makes `/tmp` in the root of `pid`'s mount namespace if it has none (CRIU, which runs there
/// as root, probes the kernel in it; small images such as busybox have none). Nothing is done
/// to what is there already: the container owns it, and a path it controls is not followed
/// any further than `mkdir` does (which never follows the last component).
pub fn ensure_tmp(pid: i32) -> io::Result<()> {
    let tmp = PathBuf::from(format!("/proc/{pid}/root/tmp"));
    match std::fs::DirBuilder::new().mode(0o1777).create(&tmp) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        made => made,
    }
}

/// Has the pid namespace whose init is `init` hand out pids above `highest` from now on, so
/// that neither CRIU (which runs in it) nor anything started meanwhile takes a pid a restored
/// process needs, and waits (a while) until none of the pids in `needed` is in use there: a
/// process started before (a startup probe's exec) may hold one, which CRIU's fork would
/// then fail on ("File exists"). The kernel's `ns_last_pid` applies to the writer's pid
/// namespace, so a process forked into it writes it (through this host's /proc, where it is
/// writable). Run through stasisd's `reaper`, which alone waits for children.
pub async fn reserve_pids(reaper: &Reaper, init: i32, highest: i32, needed: &[i32]) -> io::Result<()> {
    let mut cmd = Command::new("nsenter");
    cmd.args(["--target", &init.to_string(), "--pid", "--", "/bin/sh", "-c"])
        .arg(format!("echo {highest} > /proc/sys/kernel/ns_last_pid"));
    match reaper.run(cmd).await? {
        (ExitKind::Exited(0), _) => {}
        (how, stderr) => {
            return Err(io::Error::other(format!(
                "setting the next pid in process {init}'s namespace failed ({how}): {}",
                stderr.trim()
            )));
        }
    }
    let deadline = Instant::now() + TAKEN_PID_WAIT;
    loop {
        let wanted = needed.to_vec();
        let scan = tokio::task::spawn_blocking(move || taken(init, &wanted)).await;
        let Some((inner, host)) = scan.map_err(io::Error::other)?? else { return Ok(()) };
        if Instant::now() >= deadline {
            let comm = ProcStat::read(host).map(|s| s.comm).unwrap_or_default();
            return Err(io::Error::other(format!(
                "pid {inner} in the container, which the restored tree needs, has been taken by process \
                 {host} ({comm}) for over {} s",
                TAKEN_PID_WAIT.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A task (process or thread) of the pid namespace whose init is `init` (not the init)
/// holding one of the pids `needed` there: that pid and its host pid.
fn taken(init: i32, needed: &[i32]) -> io::Result<Option<(i32, i32)>> {
    let namespace = pid_namespace(init)?;
    Ok(proc::all_pids()
        .into_iter()
        .filter(|&pid| pid != init && pid_namespace(pid).ok() == Some(namespace))
        .flat_map(proc::threads)
        .find_map(|tid| Some((proc::pid_inside(tid, init).filter(|inner| needed.contains(inner))?, tid))))
}

/// The inode of `pid`'s pid namespace: equal for two processes of one container.
pub fn pid_namespace(pid: i32) -> io::Result<u64> {
    Ok(std::fs::metadata(format!("/proc/{pid}/ns/pid"))?.ino())
}

/// What descriptor `fd` of `pid` is (`pipe:[123]`, `/dev/null`), as CRIU names it for
/// `inherit_fd`.
pub fn fd_target(pid: i32, fd: i32) -> io::Result<String> {
    Ok(std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))?.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
35 25 0:30 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
36 25 0:31 / /sys/fs/cgroup/systemd rw,nosuid - cgroup cgroup rw,xattr,name=systemd
40 25 0:35 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
41 25 0:36 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory";

    #[test]
    fn a_task_holding_a_needed_pid_in_the_namespace_is_found() {
        // A pid namespace whose init (sh, pid 1 there) has one child, python (pid 2 there),
        // which started a thread (pid 3 there). Debian's python: a wrapper (pyenv's) would
        // take pids there first.
        let script = "import threading, time\n\
                      threading.Thread(target=time.sleep, args=(30,)).start(); print(flush=True); time.sleep(30)";
        let mut unshare = Command::new("unshare")
            .args([
                "--pid",
                "--fork",
                "--kill-child",
                "sh",
                "-c",
                &format!("/usr/bin/python3 -c '{script}' & wait"),
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(unshare.stdout.take().unwrap()), &mut line)
            .unwrap();
        let found = (|| {
            let init = *proc::children(unshare.id() as i32).ok()?.first()?;
            let python = *proc::children(init).ok()?.first()?;
            let scan = |needed: &[i32]| taken(init, needed).ok();
            Some((init, python, scan(&[2, 5])?, scan(&[3])?, scan(&[4, 5])?))
        })();
        unshare.kill().unwrap();
        unshare.wait().unwrap();
        let (init, python, process, thread, free) = found.expect("the namespace's init and its child");
        assert_eq!(process, Some((2, python)), "python holds pid 2 under init {init}");
        assert!(
            thread.is_some_and(|(inner, tid)| inner == 3 && tid != python),
            "its thread holds 3: {thread:?}"
        );
        assert_eq!(free, None, "nothing holds 4 or 5, and the init itself does not count");
    }

    #[test]
    fn each_hierarchy_is_found_by_its_controllers() {
        let at = |c| hierarchy_mount(HYBRID, c).map(|p| p.display().to_string());
        assert_eq!(at("").as_deref(), Some("/sys/fs/cgroup/unified"));
        assert_eq!(at("name=systemd").as_deref(), Some("/sys/fs/cgroup/systemd"));
        assert_eq!(at("cpu,cpuacct").as_deref(), Some("/sys/fs/cgroup/cpu,cpuacct"));
        assert_eq!(at("memory").as_deref(), Some("/sys/fs/cgroup/memory"));
        assert_eq!(at("pids"), None);
    }

    #[test]
    fn this_process_joins_its_own_cgroups() {
        let files = cgroup_procs_files(std::process::id() as i32).unwrap();
        assert!(!files.is_empty());
        for file in files {
            let members = std::fs::read_to_string(&file).unwrap();
            let me = std::process::id().to_string();
            assert!(members.lines().any(|l| l == me), "{} lacks this process", file.display());
        }
    }
}
