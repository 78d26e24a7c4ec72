//! What a tree may hold that CRIU cannot checkpoint, found from /proc before anything is
//! frozen. CRIU itself finds these only in the middle of its dump, with the tree frozen and
//! its parasite inside, and says so in terms of its own internals ("send_fds failed"); stasis
//! refuses up front, naming the process and what it holds.
//!
//! - an io_uring instance (`anon_inode:[io_uring]`): CRIU has no dumper for it;
//! - memory from `memfd_secret` (`/secretmem`): the kernel keeps it out of every other
//!   process's reach, CRIU's included;
//! - a process sharing its address space with another process (a `vfork`ed child that has
//!   not yet called `exec`, which keeps its parent suspended; `clone(CLONE_VM)` without
//!   threads): CRIU dumps one address space per process;
//! - a process of another user, when stasisd lacks CAP_SYS_RESOURCE (a root in some
//!   containers and VMs): CRIU reads every process's resource limits with prlimit(2), which
//!   the kernel allows across users only with that capability.

use std::path::Path;

use crate::linux::proc::{self, ProcStat};
use crate::linux::sys;

/// Why CRIU cannot checkpoint what descriptor `fd` of process `pid` points to (`target`, as
/// /proc names it), if it cannot.
pub fn descriptor(pid: i32, fd: i32, target: &Path) -> Option<String> {
    let what = match target.to_str()? {
        "anon_inode:[io_uring]" => "an io_uring instance",
        t if is_secret_memory(t) => "secret memory (memfd_secret)",
        _ => return None,
    };
    Some(format!("{} holds {what} (descriptor {fd}), which CRIU cannot checkpoint", process(pid)))
}

/// Why CRIU cannot checkpoint the memory of process `pid`, mapping `paths` (as
/// /proc/PID/maps names them), if it cannot.
pub fn mappings(pid: i32, paths: &[String]) -> Option<String> {
    paths.iter().any(|p| is_secret_memory(p)).then(|| {
        format!(
            "{} maps secret memory (memfd_secret), which no other process, CRIU included, can read",
            process(pid)
        )
    })
}

/// Why CRIU cannot checkpoint process `pid` of a tree whose processes are `pids`, if it
/// shares its address space with its parent there.
pub fn shared_address_space(pid: i32, pids: &[i32]) -> Option<String> {
    let parent = ProcStat::read(pid).ok()?.ppid;
    if !pids.contains(&parent) || !sys::share_memory(pid, parent).ok()? {
        return None;
    }
    Some(format!(
        "{} shares its address space with its parent, {} (a vfork()ed child that has not called exec, \
         or clone(CLONE_VM)); CRIU checkpoints one address space per process",
        process(pid),
        process(parent)
    ))
}

/// Who stasisd (and the CRIU it runs) is, as prlimit(2) judges it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    /// Whether it holds CAP_SYS_RESOURCE.
    pub sys_resource: bool,
}

/// `CAP_SYS_RESOURCE` in capability.h.
const CAP_SYS_RESOURCE: u32 = 24;

impl Caller {
    /// This process.
    pub fn this_process() -> Caller {
        Caller {
            uid: nix::unistd::getuid().as_raw(),
            gid: nix::unistd::getgid().as_raw(),
            sys_resource: proc::has_capability(CAP_SYS_RESOURCE),
        }
    }
}

/// Why CRIU, run by `caller`, cannot read the resource limits of process `pid`, if it cannot:
/// its real, effective and saved user and group ids are not all the caller's, and the caller
/// lacks CAP_SYS_RESOURCE.
pub fn resource_limits(pid: i32, caller: Caller) -> Option<String> {
    if caller.sys_resource {
        return None;
    }
    let (uids, gids) = (proc::uids(pid).ok()?, proc::gids(pid).ok()?);
    let own = |ids: [u32; 4], id: u32| ids[..3].iter().all(|&i| i == id);
    if own(uids, caller.uid) && own(gids, caller.gid) {
        return None;
    }
    Some(format!(
        "{} runs as uid {} (gid {}), and stasisd lacks CAP_SYS_RESOURCE, without which CRIU cannot read \
         another user's resource limits (prlimit); give stasisd that capability",
        process(pid),
        uids[1],
        gids[1]
    ))
}

/// `memfd_secret`'s files, named `secretmem` in a mount of their own: `/secretmem (deleted)`.
fn is_secret_memory(path: &str) -> bool {
    path.starts_with("/secretmem")
}

/// `process 1234 (python3)`.
fn process(pid: i32) -> String {
    match ProcStat::read(pid) {
        Ok(stat) => format!("process {pid} ({})", stat.comm),
        Err(_) => format!("process {pid}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_uring_and_secret_memory_are_named() {
        let me = std::process::id() as i32;
        let why = descriptor(me, 5, Path::new("anon_inode:[io_uring]")).unwrap();
        assert!(why.starts_with(&format!("process {me} (")), "{why}");
        assert!(
            why.ends_with("holds an io_uring instance (descriptor 5), which CRIU cannot checkpoint"),
            "{why}"
        );
        assert!(descriptor(me, 6, Path::new("/secretmem (deleted)")).unwrap().contains("memfd_secret"));
        assert_eq!(descriptor(me, 7, Path::new("anon_inode:[eventfd]")), None);
        assert_eq!(descriptor(me, 8, Path::new("/tmp/secretmemory.txt")), None);
        assert!(mappings(me, &["/usr/lib/libc.so.6".into(), "/secretmem (deleted)".into()]).is_some());
        assert_eq!(mappings(me, &["/usr/lib/libc.so.6".into()]), None);
    }

    #[test]
    fn another_users_process_is_refused_only_without_cap_sys_resource() {
        let me = std::process::id() as i32;
        let (uid, gid) = (nix::unistd::getuid().as_raw(), nix::unistd::getgid().as_raw());
        let plain = Caller { uid, gid, sys_resource: false };
        assert_eq!(resource_limits(me, plain), None, "its own process");
        let other = Caller { uid: uid + 1, ..plain };
        let why = resource_limits(me, other).unwrap();
        assert!(
            why.contains(&format!("runs as uid {uid} (gid {gid}), and stasisd lacks CAP_SYS_RESOURCE")),
            "{why}"
        );
        assert_eq!(resource_limits(me, Caller { sys_resource: true, ..other }), None);
    }

    #[test]
    fn a_child_with_its_own_address_space_is_fine() {
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        let pid = child.id() as i32;
        let me = std::process::id() as i32;
        let verdict = shared_address_space(pid, &[me, pid]);
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(verdict, None);
    }
}
