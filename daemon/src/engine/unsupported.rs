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
//!   the kernel allows across users only with that capability;
//! - `/dev/tty` held open where CRIU cannot tie it back to a terminal of the tree: CRIU restores
//!   it only through the first descriptor of its holder's controlling terminal that it dumps,
//!   when that is the holder's own and the terminal's foreground group is its session's (tmux's
//!   server holds the master of the terminal its shell opened `/dev/tty` on; a job of an
//!   outside shell has the shell's terminal): "ctty inheritance detected";
//! - on kernels before 5.13 only, a process in which glibc registered restartable sequences
//!   (see [`registers_rseq`]): CRIU reads a registration with PTRACE_GET_RSEQ_CONFIGURATION,
//!   which those kernels lack ("has rseq but kernel lacks get_rseq_conf feature"). The
//!   kernel's release decides whether this one applies (`inspect::kernel_refusal`).

use std::collections::{BTreeSet, HashMap};
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

/// One end of a pseudo-terminal a process holds: its number (`/dev/pts/N`), and whether it is
/// the master.
pub type PtyEnd = (u32, bool);

/// Why CRIU cannot restore the tree's `/dev/tty`, if it cannot. CRIU records `/dev/tty` once,
/// as the first process in its dump order to hold it (`holder`) sees it, and ties it to the
/// first descriptor of that process's controlling terminal it dumps: a master, or a slave
/// held by a process whose controlling terminal it is. `order` is the tree in CRIU's dump
/// order (see `proc::process_tree`), `ptys` the ends each process holds.
pub fn terminal_reopened(
    holder: i32,
    order: &[i32],
    ptys: &HashMap<i32, BTreeSet<PtyEnd>>,
) -> Option<String> {
    let stat = ProcStat::read(holder).ok()?;
    // It lost its controlling terminal after opening /dev/tty: left to CRIU.
    if stat.tty_nr == 0 {
        return None;
    }
    let holds = format!("{} holds /dev/tty", process(holder));
    let why = " (CRIU: \"ctty inheritance detected\")";
    let Some(index) = pty_number(stat.tty_nr) else {
        return Some(format!(
            "{holds}, and its controlling terminal is not a pseudo-terminal; CRIU restores /dev/tty only \
             through one the tree holds{why}"
        ));
    };
    let holds_end = |p: i32, end: PtyEnd| ptys.get(&p).is_some_and(|held| held.contains(&end));
    if !order.iter().any(|&p| holds_end(p, (index, true))) {
        return Some(format!(
            "{holds}, and its terminal /dev/pts/{index} is outside the tree (its master is a shell's or a \
             terminal emulator's): the restored tree gets a new terminal, to which CRIU cannot tie \
             /dev/tty{why}"
        ));
    }
    if stat.tpgid != stat.session {
        return Some(format!(
            "{holds} while process group {} is in the foreground of its terminal /dev/pts/{index}, not its \
             session's ({}); CRIU restores /dev/tty only for a session in its terminal's foreground{why}",
            stat.tpgid, stat.session
        ));
    }
    let controls = |p: i32| ProcStat::read(p).is_ok_and(|s| s.tty_nr == stat.tty_nr);
    let first = order
        .iter()
        .copied()
        .find(|&p| holds_end(p, (index, true)) || (holds_end(p, (index, false)) && controls(p)));
    match first {
        Some(first) if first != holder => Some(format!(
            "{holds}, and {} holds its terminal /dev/pts/{index} before it in CRIU's dump order; CRIU \
             restores /dev/tty only through the first such descriptor, and only for its own process{why}",
            process(first)
        )),
        _ => None,
    }
}

/// glibc's tunable that keeps it from registering restartable sequences, and the variable
/// that carries it.
const RSEQ_TUNABLE: &str = "glibc.pthread.rseq";
const TUNABLES_VARIABLE: &str = "GLIBC_TUNABLES";

/// Whether glibc registered restartable sequences (rseq) in a process that maps the files
/// `mapped` (as /proc/PID/maps names them) and started with `environment` (/proc/PID/environ):
/// it runs glibc's shared libc.so.6 (a static or musl program does not), and its initial
/// environment does not set `glibc.pthread.rseq=0` in GLIBC_TUNABLES. glibc reads its tunables
/// once, as the program starts, so the environment it started with is the one that counts; the
/// last setting of the tunable wins, as in glibc. glibc 2.35 and later register rseq in every
/// thread; glibc before 2.34 names its library `libc-2.NN.so`, so it does not count (2.34 is
/// counted though it registers none). When the environment cannot be read, nothing is known
/// and the process is not counted.
pub fn registers_rseq(mapped: &[String], environment: Option<&[String]>) -> bool {
    let runs_glibc = mapped.iter().any(|path| {
        let path = path.strip_suffix(DELETED).unwrap_or(path);
        Path::new(path).file_name().is_some_and(|name| name == "libc.so.6")
    });
    let Some(environment) = environment.filter(|_| runs_glibc) else { return false };
    let setting = tunables(environment)
        .flat_map(|value| value.split(':'))
        .filter_map(|tunable| tunable.strip_prefix(RSEQ_TUNABLE)?.strip_prefix('='))
        .next_back();
    setting.is_none_or(|value| value.parse::<u32>() != Ok(0))
}

/// The parts of GLIBC_TUNABLES in `environment` (/proc/PID/environ's entries), in order. glibc
/// before 2.39 ends each tunable it takes with a NUL written over the `:` after it, in the
/// environment itself, so that /proc shows `GLIBC_TUNABLES=glibc.malloc.arena_max=2` and then
/// `glibc.pthread.rseq=0` as an entry of its own: an entry after GLIBC_TUNABLES's whose name has
/// a dot (a tunable's, never a variable's) is the rest of it.
fn tunables(environment: &[String]) -> impl DoubleEndedIterator<Item = &str> {
    let mut within = false;
    let mut parts = Vec::new();
    for entry in environment {
        if let Some(value) = entry.strip_prefix(TUNABLES_VARIABLE).and_then(|rest| rest.strip_prefix('=')) {
            within = true;
            parts.push(value);
        } else if within && entry.split('=').next().is_some_and(|name| name.contains('.')) {
            parts.push(entry.as_str());
        } else {
            within = false;
        }
    }
    parts.into_iter()
}

/// Why CRIU cannot checkpoint process `pid` (command `name`), in which glibc registered
/// restartable sequences, on a kernel that keeps it from reading them (`why`, as
/// `support::rseq_dumpable` says).
pub fn rseq(pid: i32, name: Option<&str>, why: &str) -> String {
    let who = match name {
        Some(name) => format!("process {pid} ({name})"),
        None => format!("process {pid}"),
    };
    format!(
        "{who} runs glibc without {TUNABLES_VARIABLE}={RSEQ_TUNABLE}=0 in its environment, so glibc registered \
         restartable sequences (rseq) in it, and {why}; start it with `stasis run` (which sets that tunable on \
         such kernels), or with {TUNABLES_VARIABLE}={RSEQ_TUNABLE}=0 in its environment, or run it on Linux 5.13 \
         or newer"
    )
}

/// How /proc marks the path of a file that was unlinked (a library replaced by an upgrade).
const DELETED: &str = " (deleted)";

/// The slave number of a pseudo-terminal from its device number as /proc/PID/stat gives it
/// (`tty_nr`), if it is one: devpts numbers its slaves as minors of major 136.
fn pty_number(tty_nr: i32) -> Option<u32> {
    let dev = tty_nr as u32;
    let (major, minor) = ((dev >> 8) & 0xfff, (dev & 0xff) | ((dev >> 12) & 0xf_ff00));
    (major == 136).then_some(minor)
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
    fn glibc_registers_rseq_unless_its_tunable_says_no() {
        let list = |items: &[&str]| items.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let glibc = list(&["/usr/bin/python3.11", "/usr/lib/x86_64-linux-gnu/libc.so.6"]);
        let registers = |mapped: &[String], env: &[&str]| registers_rseq(mapped, Some(&list(env)));
        assert!(registers(&glibc, &["PATH=/bin"]), "no tunables");
        assert!(registers(&glibc, &["GLIBC_TUNABLES=glibc.malloc.arena_max=2"]), "other tunables");
        assert!(registers(&glibc, &["GLIBC_TUNABLES=glibc.pthread.rseq=1"]));
        assert!(
            registers(&glibc, &["GLIBC_TUNABLES=glibc.pthread.rseq=0:glibc.pthread.rseq=1"]),
            "last wins"
        );
        assert!(registers(&glibc, &["MY_GLIBC_TUNABLES=glibc.pthread.rseq=0"]), "another variable");
        assert!(!registers(&glibc, &["GLIBC_TUNABLES=glibc.pthread.rseq=0"]));
        assert!(!registers(&glibc, &["A=1", "GLIBC_TUNABLES=glibc.mem.tagging=0:glibc.pthread.rseq=0"]));
        let upgraded = list(&["/usr/lib/x86_64-linux-gnu/libc.so.6 (deleted)"]);
        assert!(registers(&upgraded, &[]), "a libc replaced since it started");
        assert!(!registers(&list(&["/usr/local/bin/server"]), &[]), "static");
        assert!(!registers(&list(&["/lib/ld-musl-x86_64.so.1"]), &[]), "musl");
        assert!(!registers(&list(&["/lib/x86_64-linux-gnu/libc-2.31.so"]), &[]), "glibc 2.31");
        assert!(!registers(&list(&["/opt/libc.so.6.bak"]), &[]));
        assert!(!registers_rseq(&glibc, None), "an environment that cannot be read tells nothing");
        // As glibc 2.36 leaves it: a NUL written after each tunable it took.
        let split = ["GLIBC_TUNABLES=glibc.malloc.arena_max=2", "glibc.pthread.rseq=0", "ZZZ=1"];
        assert!(!registers(&glibc, &split), "{split:?}");
        let reset = ["GLIBC_TUNABLES=glibc.pthread.rseq=0", "glibc.pthread.rseq=1", "Z=1"];
        assert!(registers(&glibc, &reset), "{reset:?}");
        let after = ["GLIBC_TUNABLES=glibc.malloc.arena_max=2", "Z=1", "glibc.pthread.rseq=0"];
        assert!(registers(&glibc, &after), "not GLIBC_TUNABLES's any more: {after:?}");
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
    fn pseudo_terminal_numbers_come_from_the_device_number() {
        assert_eq!(pty_number(34816), Some(0), "136:0, /dev/pts/0");
        assert_eq!(pty_number((136 << 8) | 5), Some(5));
        assert_eq!(pty_number((136 << 8) | (1 << 20)), Some(256), "minor 256's high bits");
        assert_eq!(pty_number(0x0400), None, "4:0, /dev/tty0");
    }

    #[test]
    fn dev_tty_is_refused_unless_its_process_holds_its_terminal_first() {
        // A session leader with a pseudo-terminal of its own as its controlling terminal, and
        // /dev/tty open.
        let script = "import os, fcntl, termios, time\n\
                      os.setsid(); m, s = os.openpty(); fcntl.ioctl(s, termios.TIOCSCTTY, 0)\n\
                      os.open('/dev/tty', os.O_RDWR); print(os.ttyname(s), flush=True); time.sleep(30)\n";
        let mut child = std::process::Command::new("python3")
            .args(["-c", script])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line)
            .unwrap();
        let pid = child.id() as i32;
        let n: u32 = line.trim().strip_prefix("/dev/pts/").unwrap().parse().unwrap();
        // Not a process: what it holds does not control the terminal.
        let other = pid + 100_000;
        let held = |list: &[(i32, &[PtyEnd])]| -> HashMap<i32, BTreeSet<PtyEnd>> {
            list.iter().map(|&(p, ends)| (p, ends.iter().copied().collect())).collect()
        };
        let both: &[PtyEnd] = &[(n, true), (n, false)];
        let own = terminal_reopened(pid, &[pid], &held(&[(pid, both)]));
        let master_first =
            terminal_reopened(pid, &[other, pid], &held(&[(other, &[(n, true)]), (pid, both)]));
        let slave_first =
            terminal_reopened(pid, &[other, pid], &held(&[(other, &[(n, false)]), (pid, both)]));
        let external = terminal_reopened(pid, &[pid], &held(&[(pid, &[(n, false)])]));
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(own, None, "its own terminal, held by itself first");
        let why = master_first.unwrap();
        assert!(why.contains(&format!("process {other} holds its terminal /dev/pts/{n}")), "{why}");
        assert!(why.contains("ctty inheritance"), "{why}");
        assert_eq!(slave_first, None, "a slave that is not its holder's controlling terminal does not count");
        assert!(external.unwrap().contains("outside the tree"), "a terminal whose master is elsewhere");
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
