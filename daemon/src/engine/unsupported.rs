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
//!   threads): CRIU dumps one address space per process.

use std::path::Path;

use crate::linux::proc::ProcStat;
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
