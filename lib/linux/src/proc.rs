//! Reading process state from /proc.

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::path::PathBuf;

use nix::unistd::Pid;

/// The fields of `/proc/PID/stat` stasis uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcStat {
    pub pid: i32,
    pub comm: String,
    /// R, S, D, T, t, Z, X, ...
    pub state: char,
    pub ppid: i32,
    pub pgrp: i32,
    pub session: i32,
    pub tty_nr: i32,
    /// The foreground process group of its controlling terminal (-1 without one).
    pub tpgid: i32,
    /// When the process started, in clock ticks since boot: with the pid, it names one process
    /// (a pid can be reused, this pair cannot).
    pub start_time: Option<u64>,
    /// The kernel's per-task flags (`PF_*`).
    pub flags: Option<u32>,
}

impl ProcStat {
    /// Reads `/proc/PID/stat`.
    pub fn read(pid: i32) -> io::Result<Self> {
        let text = fs::read_to_string(format!("/proc/{pid}/stat"))?;
        Self::parse(&text)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("malformed /proc/{pid}/stat")))
    }

    /// Parses the contents of a stat file. The command name is in parentheses and may itself
    /// contain spaces and parentheses, so fields are counted from the last ')'.
    pub fn parse(text: &str) -> Option<Self> {
        let open = text.find('(')?;
        let close = text.rfind(')')?;
        let pid = text[..open].trim().parse().ok()?;
        let comm = text[open + 1..close].to_string();
        let mut rest = text[close + 1..].split_whitespace();
        let state = rest.next()?.chars().next()?;
        let mut num = || rest.next()?.parse::<i32>().ok();
        let ppid = num()?;
        let pgrp = num()?;
        let session = num()?;
        let tty_nr = num()?;
        let tpgid = num()?;
        // Field 9 is the flags; 10 to 21 (minflt .. itrealvalue) are skipped; 22 is the start
        // time.
        let flags = rest.next().and_then(|f| f.parse().ok());
        let start_time = rest.nth(12).and_then(|t| t.parse().ok());
        Some(Self { pid, comm, state, ppid, pgrp, session, tty_nr, tpgid, start_time, flags })
    }

    /// A zombie or dead task: it holds its pid but runs no more.
    pub fn is_dead(&self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }

    /// A kernel thread (`PF_KTHREAD`): no user-space process to checkpoint.
    pub fn is_kernel_thread(&self) -> bool {
        const PF_KTHREAD: u32 = 0x0020_0000;
        self.flags.is_some_and(|f| f & PF_KTHREAD != 0)
    }

    /// Stopped by a signal (or a tracer).
    pub fn is_stopped(&self) -> bool {
        matches!(self.state, 'T' | 't')
    }
}

/// Whether `pid` exists and is not a zombie.
pub fn is_running(pid: i32) -> bool {
    ProcStat::read(pid).is_ok_and(|s| !s.is_dead())
}

/// The root and all its descendants, depth first, each process before its children and
/// children in the kernel's order (its threads' `children` files): the order in which CRIU
/// walks, and dumps, a tree.
pub fn process_tree(root: i32) -> io::Result<Vec<i32>> {
    let mut seen = Vec::new();
    let mut stack = vec![root];
    while let Some(pid) = stack.pop() {
        if seen.contains(&pid) {
            continue;
        }
        seen.push(pid);
        stack.extend(children(pid)?.into_iter().rev());
    }
    Ok(seen)
}

/// The root of the tree CRIU (process `criu`) is restoring into a new pid namespace: the
/// init of a namespace below ours that CRIU traces (it holds the tree until it resumes it).
/// CRIU creates it as its own child or, restoring as a sibling, as a child of ours.
pub fn restoring_namespace_root(criu: i32) -> Option<i32> {
    let mut candidates = children(criu).unwrap_or_default();
    candidates.extend(children(std::process::id() as i32).unwrap_or_default());
    candidates.into_iter().find(|&pid| is_namespace_init(pid) && tracer(pid) == Some(criu))
}

/// The root of the tree a CRIU started by `launcher` (which forked it into a container's
/// namespaces) is restoring: the process CRIU traces whose parent it does not.
pub fn restored_root_under(launcher: i32) -> Option<i32> {
    let criu: Vec<i32> = std::iter::once(launcher).chain(children(launcher).unwrap_or_default()).collect();
    let traced = |pid: i32| tracer(pid).is_some_and(|t| criu.contains(&t));
    let parent = |pid: i32| ProcStat::read(pid).ok().map(|s| s.ppid);
    process_tree(launcher).ok()?.into_iter().find(|&p| traced(p) && !parent(p).is_some_and(traced))
}

/// Whether `pid` is the init of a pid namespace below this one.
pub fn is_namespace_init(pid: i32) -> bool {
    ns_pids(pid).is_ok_and(|ns| ns.len() > 1 && ns.last() == Some(&1))
}

/// The pid of `pid` inside the pid namespace of which `root` is the init (at `root`'s level,
/// also for a process in a namespace nested deeper).
pub fn pid_inside(pid: i32, root: i32) -> Option<i32> {
    let level = ns_pids(root).ok()?.len() - 1;
    ns_pids(pid).ok()?.get(level).copied()
}

/// The process tracing `pid` (its `TracerPid`), if one does.
pub fn tracer(pid: i32) -> Option<i32> {
    let tracer: i32 = status_field(pid, "TracerPid").ok()??.parse().ok()?;
    (tracer != 0).then_some(tracer)
}

/// Field `key` of `/proc/PID/status` (what follows `key:`, trimmed); `None` without one.
fn status_field(pid: i32, key: &str) -> io::Result<Option<String>> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    Ok(field_of(&status, key).map(str::to_owned))
}

fn field_of<'a>(status: &'a str, key: &str) -> Option<&'a str> {
    status.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(':')).map(str::trim)
}

/// The thread ids of `pid` (its own among them); none once it is gone.
pub fn threads(pid: i32) -> Vec<i32> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten();
    tasks.filter_map(|t| t.file_name().to_str()?.parse().ok()).collect()
}

/// The children of every thread of `pid`.
pub fn children(pid: i32) -> io::Result<Vec<i32>> {
    let mut out = Vec::new();
    let tasks = match fs::read_dir(format!("/proc/{pid}/task")) {
        Ok(t) => t,
        // The process exited while we walked the tree.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for task in tasks {
        let path = task?.path().join("children");
        let Ok(text) = fs::read_to_string(&path) else {
            continue;
        };
        out.extend(text.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
    }
    Ok(out)
}

/// The real, effective, saved and file-system user ids of `pid`.
pub fn uids(pid: i32) -> io::Result<[u32; 4]> {
    ids(pid, "Uid")
}

/// The real, effective, saved and file-system group ids of `pid`.
pub fn gids(pid: i32) -> io::Result<[u32; 4]> {
    ids(pid, "Gid")
}

/// The four ids of `pid`'s `Uid` or `Gid` line.
fn ids(pid: i32, key: &str) -> io::Result<[u32; 4]> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    parse_ids(&status, key).ok_or_else(|| io::Error::other(format!("no {key} line in /proc/{pid}/status")))
}

fn parse_ids(status: &str, key: &str) -> Option<[u32; 4]> {
    let line = field_of(status, key)?;
    let ids: Vec<u32> = line.split_whitespace().map(str::parse).collect::<Result<_, _>>().ok()?;
    ids.try_into().ok()
}

/// Whether this process holds capability number `cap` (`CAP_*` of capability.h) in its
/// effective set.
pub fn has_capability(cap: u32) -> bool {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    let effective = field_of(&status, "CapEff").and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok());
    effective.is_some_and(|set| set & (1 << cap) != 0)
}

/// The pids of `pid` in each pid namespace it belongs to, outermost (this one's) first: its
/// `NSpid` line. One entry for a process of this namespace.
pub fn ns_pids(pid: i32) -> io::Result<Vec<i32>> {
    let line = status_field(pid, "NSpid")?;
    let pids = line.map(|l| l.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<i32>>());
    pids.filter(|p| !p.is_empty())
        .ok_or_else(|| io::Error::other(format!("no NSpid line in /proc/{pid}/status")))
}

/// The program `pid` runs.
pub fn exe(pid: i32) -> io::Result<PathBuf> {
    fs::read_link(format!("/proc/{pid}/exe"))
}

/// The working directory of `pid`.
pub fn cwd(pid: i32) -> io::Result<PathBuf> {
    fs::read_link(format!("/proc/{pid}/cwd"))
}

/// The pids of all processes now visible in /proc.
pub fn all_pids() -> Vec<i32> {
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    entries.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok()).collect()
}

/// The command line of `pid`, split at NULs.
pub fn cmdline(pid: i32) -> io::Result<Vec<String>> {
    let raw = fs::read(format!("/proc/{pid}/cmdline"))?;
    Ok(raw
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect())
}

/// Where each open descriptor of `pid` points (`readlink /proc/PID/fd/N`).
pub fn fd_targets(pid: i32) -> io::Result<Vec<(i32, PathBuf)>> {
    let mut out = Vec::new();
    for entry in fs::read_dir(format!("/proc/{pid}/fd"))? {
        let entry = entry?;
        let Some(fd) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        if let Ok(target) = fs::read_link(entry.path()) {
            out.push((fd, target));
        }
    }
    Ok(out)
}

/// The paths of the files `pid` has mapped, from `/proc/PID/maps` (deleted ones keep their
/// " (deleted)" suffix); empty when unreadable.
pub fn mapped_paths(pid: i32) -> Vec<String> {
    let Ok(text) = fs::read_to_string(format!("/proc/{pid}/maps")) else { return Vec::new() };
    let mut paths: Vec<String> = text
        .lines()
        .filter_map(|l| l.splitn(6, ' ').nth(5))
        .map(str::trim)
        .filter(|p| p.starts_with('/'))
        .map(String::from)
        .collect();
    paths.sort_unstable();
    paths.dedup();
    paths
}

/// The writable private mappings of `pid` (anonymous or file-backed), as `[start, end)`
/// address ranges in ascending order, from `/proc/PID/maps`.
pub fn private_writable_ranges(pid: i32) -> io::Result<Vec<(u64, u64)>> {
    Ok(parse_private_writable(&fs::read_to_string(format!("/proc/{pid}/maps"))?))
}

/// Parses `/proc/PID/maps` lines like `7f00-7f80 rw-p 00000000 00:00 0`.
pub fn parse_private_writable(text: &str) -> Vec<(u64, u64)> {
    text.lines()
        .filter_map(|line| {
            let mut cols = line.split_whitespace();
            let (range, perms) = (cols.next()?, cols.next()?.as_bytes());
            if perms.get(1) != Some(&b'w') || perms.get(3) != Some(&b'p') {
                return None;
            }
            let (start, end) = range.split_once('-')?;
            Some((u64::from_str_radix(start, 16).ok()?, u64::from_str_radix(end, 16).ok()?))
        })
        .collect()
}

/// Pids holding POSIX or flock locks, from `/proc/locks`.
pub fn lock_holders() -> io::Result<BTreeSet<i32>> {
    Ok(parse_locks(&fs::read_to_string("/proc/locks")?))
}

/// Parses `/proc/locks` lines like `1: POSIX  ADVISORY  WRITE 1234 00:2a:5 0 EOF`.
pub fn parse_locks(text: &str) -> BTreeSet<i32> {
    text.lines()
        .filter(|l| !l.contains("->")) // blocked waiters, not holders
        .filter_map(|l| l.split_whitespace().nth(4)?.parse().ok())
        .collect()
}

/// CPU time of every thread of `pid`: the first field of each thread's `schedstat`
/// (nanoseconds, unlike `stat`'s clock ticks, which miss short bursts).
pub fn cpu_time_ns(pid: i32) -> Option<u64> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let total = tasks
        .flatten()
        .filter_map(|t| fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|text| text.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    Some(total)
}

/// `rchar` of `/proc/PID/io`.
pub fn read_chars(pid: i32) -> Option<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    text.lines().find_map(|l| l.strip_prefix("rchar:"))?.trim().parse().ok()
}

/// This machine's memory in bytes (`MemTotal` of /proc/meminfo).
pub fn memory_total() -> Option<u64> {
    let text = fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Resident memory of `pid` in bytes (`VmRSS`), 0 when unknown.
pub fn resident_bytes(pid: i32) -> u64 {
    let rss = status_field(pid, "VmRSS").ok().flatten();
    rss.and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok()).map_or(0, |kib| kib * 1024)
}

/// The CPU's user-space instruction-set extensions: x86's `flags` narrowed to those programs
/// choose code paths by, or arm64's `Features` (all of which are).
pub fn cpu_isa_flags() -> BTreeSet<String> {
    fs::read_to_string("/proc/cpuinfo").map(|text| parse_isa_flags(&text)).unwrap_or_default()
}

pub fn parse_isa_flags(cpuinfo: &str) -> BTreeSet<String> {
    const X86_EXACT: [&str; 24] = [
        "abm",
        "adx",
        "aes",
        "bmi1",
        "bmi2",
        "clflushopt",
        "clwb",
        "cx16",
        "erms",
        "f16c",
        "fma",
        "fma4",
        "fsrm",
        "gfni",
        "movbe",
        "movdir64b",
        "movdiri",
        "pclmulqdq",
        "popcnt",
        "rdrand",
        "rdseed",
        "sha_ni",
        "vaes",
        "vpclmulqdq",
    ];
    const X86_PREFIXES: [&str; 4] = ["avx", "sse", "ssse", "amx"];
    for line in cpuinfo.lines() {
        let Some((key, value)) = line.split_once(':') else { continue };
        match key.trim() {
            "flags" => {
                let isa = |f: &&str| X86_EXACT.contains(f) || X86_PREFIXES.iter().any(|p| f.starts_with(p));
                return value.split_whitespace().filter(isa).map(str::to_owned).collect();
            }
            "Features" => return value.split_whitespace().map(str::to_owned).collect(),
            _ => {}
        }
    }
    BTreeSet::new()
}

/// The running kernel's release string.
pub fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown".into())
}

/// Whether this kernel tracks soft-dirty pages (`CONFIG_MEM_SOFT_DIRTY`), which CRIU's memory
/// tracking needs: a page just mapped and written reads soft-dirty (bit 55 of its
/// /proc/self/pagemap entry) only where the kernel has it.
pub fn soft_dirty() -> Result<(), String> {
    use std::os::unix::fs::FileExt;
    let mut page = memmap2::MmapMut::map_anon(1).map_err(|e| format!("cannot map a page to probe: {e}"))?;
    page[0] = 1;
    let page_size =
        nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE).ok().flatten().unwrap_or(4096) as u64;
    let mut entry = [0u8; 8];
    fs::File::open("/proc/self/pagemap")
        .and_then(|pagemap| pagemap.read_exact_at(&mut entry, page.as_ptr() as u64 / page_size * 8))
        .map_err(|e| format!("cannot read /proc/self/pagemap: {e}"))?;
    match u64::from_le_bytes(entry) >> 55 & 1 {
        1 => Ok(()),
        _ => Err("this kernel does not track soft-dirty pages (CONFIG_MEM_SOFT_DIRTY is off)".into()),
    }
}

/// Where the kernel says which anonymous memory gets transparent huge pages.
const HUGE_PAGES_MODE: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// The kernel's transparent-huge-page mode for anonymous memory ("always", "madvise" or
/// "never"), or `None` where the kernel has no transparent huge pages. It matters to memory
/// tracking: soft-dirty is kept per page table entry, so under "always" a write anywhere in a
/// huge page marks all 2 MiB of it written.
pub fn huge_pages_mode() -> Option<String> {
    current_mode(&fs::read_to_string(HUGE_PAGES_MODE).ok()?)
}

/// The bracketed word of a sysfs mode list ("always [madvise] never" gives "madvise").
fn current_mode(modes: &str) -> Option<String> {
    modes.split_whitespace().find_map(|m| Some(m.strip_prefix('[')?.strip_suffix(']')?.to_owned()))
}

/// This machine's host name.
pub fn node_name() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.nodename().to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown".into())
}

/// Sends `signal` to every pid, ignoring ones that are already gone.
pub fn signal_all(pids: &[i32], signal: nix::sys::signal::Signal) {
    for &pid in pids {
        let _ = nix::sys::signal::kill(Pid::from_raw(pid), signal);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uids_and_gids_are_read_from_status() {
        let status = "Name:\tx\nUid:\t1000\t1000\t0\t1000\nGid:\t1\t1\t2\t1\n";
        assert_eq!(parse_ids(status, "Uid"), Some([1000, 1000, 0, 1000]));
        assert_eq!(parse_ids(status, "Gid"), Some([1, 1, 2, 1]));
        assert_eq!(parse_ids("Name:\tx\n", "Uid"), None);
        let me = std::process::id() as i32;
        assert_eq!(uids(me).unwrap()[0], nix::unistd::getuid().as_raw());
        assert_eq!(gids(me).unwrap()[0], nix::unistd::getgid().as_raw());
        // CAP_CHOWN (0): root here has it; CAP_SYS_RESOURCE (24) may be missing on this VM.
        assert_eq!(has_capability(0), nix::unistd::geteuid().is_root());
    }

    /// The probe agrees with the kernel's configuration where the kernel publishes it
    /// (/proc/config.gz, or /boot/config-RELEASE): this machine's 6.18 has soft-dirty off;
    /// Debian's kernels have it on (scripts/kernel-matrix.sh shows stasisd's answer there).
    #[test]
    fn soft_dirty_probe_agrees_with_the_kernel_config() {
        use std::io::Read;
        let found = soft_dirty();
        let config = fs::File::open("/proc/config.gz")
            .and_then(|f| {
                let mut text = String::new();
                flate2::read::GzDecoder::new(f).read_to_string(&mut text).map(|_| text)
            })
            .or_else(|_| fs::read_to_string(format!("/boot/config-{}", kernel_release())));
        match config {
            Ok(text) if text.lines().any(|l| l == "CONFIG_MEM_SOFT_DIRTY=y") => assert_eq!(found, Ok(())),
            Ok(_) => assert!(found.as_ref().is_err_and(|e| e.contains("CONFIG_MEM_SOFT_DIRTY")), "{found:?}"),
            // No configuration to compare with: the probe still answers, without an I/O error.
            Err(_) => assert!(
                found.as_ref().is_ok() || found.as_ref().is_err_and(|e| e.contains("CONFIG_MEM")),
                "{found:?}"
            ),
        }
    }

    #[test]
    fn the_huge_page_mode_is_the_bracketed_word() {
        assert_eq!(current_mode("always [madvise] never\n").as_deref(), Some("madvise"));
        assert_eq!(current_mode("[always] madvise never").as_deref(), Some("always"));
        assert_eq!(current_mode("always madvise never"), None);
        // This kernel's answer is one of the three, where it has huge pages at all.
        if let Some(mode) = huge_pages_mode() {
            assert!(["always", "madvise", "never"].contains(&mode.as_str()), "{mode}");
        }
    }

    #[test]
    fn private_writable_mappings_are_picked_from_maps() {
        let maps = "00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/prog\n\
                    00651000-00652000 rw-p 00051000 08:02 173521 /usr/bin/prog\n\
                    7f0000000000-7f0000100000 rw-p 00000000 00:00 0\n\
                    7f0000200000-7f0000300000 rw-s 00000000 00:05 99 /dev/zero (deleted)\n";
        assert_eq!(
            parse_private_writable(maps),
            vec![(0x651000, 0x652000), (0x7f0000000000, 0x7f0000100000)]
        );
    }

    #[test]
    fn stat_parses_names_with_spaces_and_parens() {
        let s = ProcStat::parse("42 (my (odd) prog) S 1 42 42 34816 43 4194560 0").unwrap();
        assert_eq!(s.pid, 42);
        assert_eq!(s.comm, "my (odd) prog");
        assert_eq!((s.state, s.ppid, s.pgrp, s.session, s.tty_nr, s.tpgid), ('S', 1, 42, 42, 34816, 43));
        assert_eq!(s.flags, Some(4194560));
        assert_eq!(s.start_time, None, "a short line has no start time");
        let me = ProcStat::read(std::process::id() as i32).unwrap();
        assert!(me.start_time.is_some_and(|t| t > 0));
        assert!(!me.is_kernel_thread());
        // kthreadd, the parent of every kernel thread, is pid 2.
        assert!(ProcStat::read(2).unwrap().is_kernel_thread());
        assert!(!s.is_dead());
        assert!(ProcStat::parse("garbage").is_none());
    }

    #[test]
    fn a_tree_is_listed_depth_first_as_criu_dumps_it() {
        // The shell forks a subshell (which forks a sleep), then a sleep of its own.
        let mut root = std::process::Command::new("sh")
            .args(["-c", "(sleep 30; true) & sleep 30; true"])
            .spawn()
            .unwrap();
        let pid = root.id() as i32;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut tree = process_tree(pid).unwrap();
        while tree.len() < 4 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
            tree = process_tree(pid).unwrap();
        }
        let stats: Vec<(String, i32)> =
            tree.iter().map(|&p| ProcStat::read(p).map(|s| (s.comm, s.ppid)).unwrap_or_default()).collect();
        for &p in tree.iter().rev() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), nix::sys::signal::Signal::SIGKILL);
        }
        root.wait().unwrap();
        let parents = [0, pid, tree[1], pid];
        let expected: Vec<(String, i32)> =
            ["sh", "sh", "sleep", "sleep"].iter().zip(parents).map(|(c, p)| (c.to_string(), p)).collect();
        let mut got = stats;
        got[0].1 = 0;
        assert_eq!(got, expected, "the subshell's child follows the subshell: {tree:?}");
    }

    #[test]
    fn locks_lists_holders_not_waiters() {
        let text = "1: POSIX  ADVISORY  WRITE 1234 00:2a:5 0 EOF\n\
1: -> POSIX  ADVISORY  WRITE 999 00:2a:5 0 EOF\n\
2: FLOCK  ADVISORY  WRITE 77 00:2a:6 0 EOF\n";
        assert_eq!(parse_locks(text).into_iter().collect::<Vec<_>>(), vec![77, 1234]);
    }

    #[test]
    fn own_process_is_visible() {
        let me = std::process::id() as i32;
        assert!(is_running(me));
        assert_eq!(process_tree(me).unwrap()[0], me);
        assert!(!fd_targets(me).unwrap().is_empty());
        assert!(resident_bytes(me) > 0);
        assert!(mapped_paths(me).iter().any(|p| p.contains("stasis_linux")), "own executable is mapped");
        assert_eq!(resident_bytes(-1), 0);
    }

    #[test]
    fn isa_flags_are_the_user_space_extensions() {
        let x86 = "processor\t: 0\nflags\t\t: fpu vme sse sse2 ssse3 sse4_1 avx avx2 hypervisor bmi2 avx512f amx_tile lm\n\nprocessor\t: 1\nflags\t\t: fpu\n";
        let got: Vec<String> = parse_isa_flags(x86).into_iter().collect();
        assert_eq!(got, ["amx_tile", "avx", "avx2", "avx512f", "bmi2", "sse", "sse2", "sse4_1", "ssse3"]);
        let arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve atomics\n";
        assert_eq!(parse_isa_flags(arm).len(), 4);
        assert!(parse_isa_flags("").is_empty());
        assert!(!cpu_isa_flags().is_empty(), "this machine's CPU has some");
    }
}
