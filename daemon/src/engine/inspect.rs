//! Working out, from /proc, what a process tree holds and so which CRIU options its dump
//! needs, so users never have to know CRIU's flags.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::io;
use std::path::PathBuf;

use super::host::Host;
use super::sockets::{self, TreeSockets};
use super::unsupported;
use crate::criu::{TreeOptions, support};
use crate::linux::fdinfo::{self, FdInfo};
use crate::linux::proc::{self, ProcStat};
use crate::linux::{init_program, pty};

/// A process tree about to be dumped.
#[derive(Debug, Clone)]
pub struct TreeInfo {
    pub pids: Vec<i32>,
    pub command: Vec<String>,
    pub options: TreeOptions,
    pub sockets: TreeSockets,
    /// Every user id (real, effective, saved, file system) its processes have.
    pub uids: BTreeSet<u32>,
    /// When each process started: a pid that later names another process is not the tree's.
    pub started: HashMap<i32, u64>,
    /// Each process's pid inside the root's own pid namespace, in the order of `pids`, when
    /// the root is that namespace's init (see `stasis-init`); empty otherwise.
    pub ns_pids: Vec<i32>,
    /// The paths of the files its processes hold open (as /proc names them).
    pub open_files: BTreeSet<PathBuf>,
    /// With `ns_pids`: the working directory of the namespace's init (see `stasis-init`).
    pub init_dir: Option<PathBuf>,
    /// With `ns_pids`: the installed stasis-init the namespace's init runs, if it is one.
    pub init_program: Option<PathBuf>,
    /// Why CRIU cannot checkpoint the tree, if something it holds is beyond CRIU (see
    /// unsupported.rs).
    pub unsupported: Option<String>,
}

/// Inspects the tree rooted at `root`.
pub fn inspect(root: i32) -> io::Result<TreeInfo> {
    let stat = ProcStat::read(root)?;
    let pids = proc::process_tree(root)?;
    let in_tree: HashSet<i32> = pids.iter().copied().collect();
    let mut options = TreeOptions {
        // A job started from a shell: its session (and terminal) belong to the shell.
        shell_job: !in_tree.contains(&stat.session) || !in_tree.contains(&stat.pgrp),
        file_locks: proc::lock_holders()?.iter().any(|p| in_tree.contains(p)),
        ..Default::default()
    };
    let sockets = sockets::survey(&pids);
    options.tcp_established = sockets.may_hold_connections();
    options.ext_unix_sk = sockets.has_unix();
    let mut open_files = BTreeSet::new();
    // Pseudo-terminal masters the tree holds (by slave number), and the slaves it holds.
    let mut masters = BTreeSet::new();
    let mut slaves = BTreeSet::new();
    // The pseudo-terminal ends each process holds, and the first (in dump order) to hold
    // /dev/tty.
    let mut ptys: HashMap<i32, BTreeSet<unsupported::PtyEnd>> = HashMap::new();
    let mut tty_holder = None;
    let mut refusals = Vec::new();
    let caller = unsupported::Caller::this_process();
    for &pid in &pids {
        refusals.extend(unsupported::resource_limits(pid, caller));
        let mapped = proc::mapped_paths(pid);
        options.link_remap |= mapped.iter().any(|p| p.ends_with(DELETED));
        refusals.extend(unsupported::mappings(pid, &mapped));
        refusals.extend(unsupported::shared_address_space(pid, &pids));
        let Ok(fds) = proc::fd_targets(pid) else {
            continue;
        };
        for (fd, target) in fds {
            let path = target.to_str().unwrap_or_default();
            options.link_remap |= path.ends_with(DELETED);
            refusals.extend(unsupported::descriptor(pid, fd, &target));
            // Open-file-description locks show no pid in /proc/locks: the descriptor says.
            let info = FdInfo::read(pid, fd).unwrap_or_default();
            options.file_locks |= info.holds_lock;
            if fdinfo::is_pty_master(path) {
                masters.extend(info.tty_index);
                ptys.entry(pid).or_default().extend(info.tty_index.map(|index| (index, true)));
            } else if let Some(index) = fdinfo::pty_slave_index(path) {
                slaves.insert((index, target.clone()));
                ptys.entry(pid).or_default().insert((index, false));
            } else if path == "/dev/tty" {
                tty_holder = tty_holder.or(Some(pid));
            }
            if target.is_absolute() {
                open_files.insert(target);
            }
        }
    }
    refusals.extend(tty_holder.and_then(|holder| unsupported::terminal_reopened(holder, &pids, &ptys)));
    for (index, slave) in slaves {
        // A terminal whose master is outside the tree: restore gives the job a new one. A pair
        // the tree holds both sides of is the tree's own, restored as it was.
        if !masters.contains(&index)
            && let Some(key) = pty::tty_key(&slave).filter(|k| !options.external.contains(k))
        {
            options.external.push(key);
        }
    }
    let started = pids.iter().filter_map(|&pid| Some((pid, ProcStat::read(pid).ok()?.start_time?))).collect();
    let ns_pids = own_namespace_pids(root, &pids);
    // stasis-init is root's, whoever's command it runs: the tree is the command's user's.
    let init_program = match ns_pids.is_empty() {
        true => None,
        false => proc::exe(root).ok().filter(|exe| init_program::is_installed(exe)),
    };
    let ours = init_program.is_some();
    let users = pids.iter().filter(|&&pid| !(ours && pid == root));
    let uids = users.filter_map(|&pid| proc::uids(pid).ok()).flatten().collect();
    let mut command = proc::cmdline(root)?;
    if !ns_pids.is_empty()
        && let Some(at) = command.iter().position(|a| a == "--")
    {
        // stasis-init's own arguments say nothing about the workload: the command after them.
        command.drain(..=at);
    }
    let init_dir = if ns_pids.is_empty() { None } else { proc::cwd(root).ok() };
    Ok(TreeInfo {
        pids,
        command,
        options,
        sockets,
        uids,
        started,
        ns_pids,
        open_files,
        init_dir,
        init_program,
        unsupported: refusals.into_iter().next(),
    })
}

/// Why this kernel keeps CRIU from dumping the tree of `pids`, though a newer one would not,
/// if it does: a process in which glibc registered restartable sequences, on a kernel where
/// CRIU cannot read them (see `unsupported::registers_rseq`). Asks nothing of the processes
/// where the kernel is not such a one.
pub fn kernel_refusal<H: Host + ?Sized>(host: &H, pids: &[i32]) -> Option<String> {
    let Err(why) = support::rseq_dumpable(&host.kernel_release()) else { return None };
    let refused = pids.iter().copied().find(|&pid| {
        unsupported::registers_rseq(&host.mapped_files(pid), host.initial_environment(pid).as_deref())
    })?;
    let command = host.command(refused).unwrap_or_default();
    let name = command.first().map(|program| program.rsplit('/').next().unwrap_or(program));
    Some(unsupported::rseq(refused, name, &why))
}

/// The environment `pid` started with, as `NAME=value` entries (/proc/PID/environ).
pub fn initial_environment(pid: i32) -> Option<Vec<String>> {
    let bytes = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let entries = bytes.split(|&b| b == 0).filter(|entry| !entry.is_empty());
    Some(entries.map(|entry| String::from_utf8_lossy(entry).into_owned()).collect())
}

/// The pids of `pids` inside `root`'s pid namespace, if `root` is its init and it is not
/// this one; empty otherwise. (Processes in namespaces nested deeper count at the root's
/// level; one that exited meanwhile gets 0, which no restored process has.)
fn own_namespace_pids(root: i32, pids: &[i32]) -> Vec<i32> {
    if !proc::is_namespace_init(root) {
        return Vec::new();
    }
    pids.iter().map(|&pid| proc::pid_inside(pid, root).unwrap_or(0)).collect()
}

/// How /proc marks a path whose file was unlinked.
const DELETED: &str = " (deleted)";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deleted_open_file_asks_for_link_remap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sem");
        std::fs::write(&path, b"x").unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .stdin(std::fs::File::open(&path).unwrap())
            .spawn()
            .unwrap();
        let before = inspect(child.id() as i32).unwrap();
        std::fs::remove_file(&path).unwrap();
        let after = inspect(child.id() as i32).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!before.options.link_remap);
        assert!(after.options.link_remap);
        assert!(after.options.describe().contains(&"link-remap".to_string()));
    }

    #[test]
    fn glibc_and_its_rseq_tunable_are_read_from_proc() {
        // `sleep` runs glibc (this machine's, 2.35 or later: it registers rseq by default).
        let start = |tunables: Option<&str>| {
            let mut cmd = std::process::Command::new("sleep");
            cmd.arg("5").env_remove("GLIBC_TUNABLES");
            if let Some(value) = tunables {
                cmd.env("GLIBC_TUNABLES", value);
            }
            cmd.spawn().unwrap()
        };
        let registers = |child: &std::process::Child| {
            let pid = child.id() as i32;
            // The loader maps libc.so.6 just after exec.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            let mut mapped = proc::mapped_paths(pid);
            while !mapped.iter().any(|p| p.contains("libc")) && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(10));
                mapped = proc::mapped_paths(pid);
            }
            unsupported::registers_rseq(&mapped, initial_environment(pid).as_deref())
        };
        let mut children = [start(None), start(Some("glibc.malloc.arena_max=2:glibc.pthread.rseq=0"))];
        let verdicts = children.each_ref().map(registers);
        for child in &mut children {
            child.kill().unwrap();
            child.wait().unwrap();
        }
        assert_eq!(verdicts, [true, false]);
    }

    #[test]
    fn a_child_started_here_is_a_shell_job_with_its_socket_seen() {
        // A child in our session and process group: its leaders are outside its tree.
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        let info = inspect(child.id() as i32).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(info.options.shell_job);
        assert_eq!(info.pids, vec![child.id() as i32]);
        assert_eq!(info.command, vec!["sleep", "5"]);
    }
}
