//! What the tests look at in /proc, and signals.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// The fields of /proc/PID/stat after the command name (which may contain spaces and
/// parentheses, hence the split after the last ')').
fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// The scheduler state of `pid` (`R`, `S`, `D`, `T`, `t`, `Z`, ...), `None` when there is no
/// such process.
pub fn proc_state(pid: i32) -> Option<char> {
    stat_fields(pid)?.first()?.chars().next()
}

/// The parent pid of `pid`.
pub fn ppid(pid: i32) -> Option<i32> {
    stat_fields(pid)?.get(1)?.parse().ok()
}

/// Some kernel thread this pid namespace can see (kthreadd, pid 2, on a host), if any.
pub fn kernel_thread() -> Option<i32> {
    const PF_KTHREAD: u64 = 0x0020_0000;
    let is_kthread = |pid: i32| {
        stat_fields(pid)
            .and_then(|f| f.get(6)?.parse::<u64>().ok())
            .is_some_and(|flags| flags & PF_KTHREAD != 0)
    };
    fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .find(|&p| is_kthread(p))
}

/// The pids of `pid` in each pid namespace it is in, outermost first.
pub fn ns_pids(pid: i32) -> Vec<i32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:")).unwrap_or_default();
    line.split_whitespace().filter_map(|p| p.parse().ok()).collect()
}

/// The pid of `pid` inside its own (innermost) pid namespace; `pid` itself if it has none
/// other than this one (or is gone).
pub fn inner(pid: i32) -> i32 {
    ns_pids(pid).last().copied().unwrap_or(pid)
}

/// Whether `pid` is the init (pid 1) of a pid namespace below this one.
pub fn is_namespace_init(pid: i32) -> bool {
    matches!(ns_pids(pid).as_slice(), [_, .., 1])
}

/// The process running a workload's command, given the root of its tree: the root, or, where
/// the root is the init of the workload's own pid namespace (stasis-init), the init's child
/// (waited for: the init forks it after `stasis run` has answered).
pub fn command_of(root: i32) -> i32 {
    if !is_namespace_init(root) {
        return root;
    }
    let only_child = || Some(children(root)).filter(|c| c.len() == 1).and_then(|c| c.into_iter().next());
    crate::expect_within(crate::TIMEOUT, &format!("the namespace init {root} to have one child"), only_child)
}

/// Whether `pid` is a live process: it exists and is neither a zombie nor dead.
pub fn alive(pid: i32) -> bool {
    matches!(proc_state(pid), Some(state) if !matches!(state, 'Z' | 'X' | 'x'))
}

/// Whether `pid` exists and is neither stopped (`T`, `t`: frozen or traced) nor a zombie.
pub fn running(pid: i32) -> bool {
    matches!(proc_state(pid), Some(state) if !matches!(state, 'T' | 't' | 'Z' | 'X' | 'x'))
}

/// The pid of the process ptrace-attached to `pid` (0 when none).
pub fn tracer(pid: i32) -> Option<i32> {
    status_field(pid, "TracerPid")?.parse().ok()
}

/// Whether /proc/PID exists at all (zombies included).
pub fn exists(pid: i32) -> bool {
    fs::metadata(format!("/proc/{pid}")).is_ok()
}

/// Waits until /proc/PID is gone (exited and reaped); panics naming `what` after
/// [`crate::TIMEOUT`].
pub fn wait_gone(pid: i32, what: &str) {
    crate::expect_within(crate::TIMEOUT, what, || (!exists(pid)).then_some(()));
}

/// The argv of `pid`.
pub fn cmdline(pid: i32) -> Option<Vec<String>> {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        raw.split(|b| *b == 0)
            .filter(|arg| !arg.is_empty())
            .map(|arg| String::from_utf8_lossy(arg).into_owned())
            .collect(),
    )
}

/// Running processes whose arguments are `such` and whose parent is no stasisd (a stasisd
/// that started them died).
pub fn orphans(such: impl Fn(&[String]) -> bool) -> Vec<i32> {
    let argv = |pid: i32| cmdline(pid).unwrap_or_default();
    let stasisd = |pid: i32| argv(pid).first().is_some_and(|a| a.ends_with("stasisd"));
    let pids = fs::read_dir("/proc").into_iter().flatten().flatten();
    pids.filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| such(&argv(pid)) && !ppid(pid).is_some_and(stasisd))
        .collect()
}

/// CRIUs (`criu swrk`, named `criu: <action> --rpc` once at work) whose stasisd died.
pub fn orphaned_criu() -> Vec<i32> {
    orphans(|argv| argv.iter().any(|a| a == "swrk" || a.starts_with("criu: ")))
}

/// The cgroup (v2) of `pid`, as /proc/PID/cgroup names it: `/stasis/<workload>` for a workload
/// stasisd runs in a cgroup of its own.
pub fn cgroup(pid: i32) -> Option<String> {
    let text = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines().find_map(|line| line.strip_prefix("0::")).map(str::to_owned)
}

/// The processes in a cgroup stasisd made for workload `name` (`.../stasis/<node>/<name>`).
pub fn in_workload_cgroup(name: &str) -> Vec<i32> {
    let suffix = format!("/{name}");
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|&pid| cgroup(pid).is_some_and(|c| c.contains("/stasis/") && c.ends_with(&suffix)))
        .collect()
}

/// The thread ids of `pid`.
pub fn tids(pid: i32) -> BTreeSet<i32> {
    fs::read_dir(format!("/proc/{pid}/task"))
        .map(|dir| dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default()
}

/// The CPU time thread `tid` of `pid` has used, in nanoseconds (0 if it is gone).
pub fn thread_cpu_ns(pid: i32, tid: i32) -> u64 {
    let schedstat = fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat")).unwrap_or_default();
    schedstat.split_whitespace().next().and_then(|ns| ns.parse().ok()).unwrap_or(0)
}

/// The children of every thread of `pid`.
pub fn children(pid: i32) -> BTreeSet<i32> {
    tids(pid)
        .into_iter()
        .filter_map(|tid| fs::read_to_string(format!("/proc/{pid}/task/{tid}/children")).ok())
        .flat_map(|text| text.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<i32>>())
        .collect()
}

/// Every descendant of `pid` (not `pid` itself).
pub fn descendants(pid: i32) -> BTreeSet<i32> {
    let mut found = BTreeSet::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        for child in children(p) {
            if found.insert(child) {
                todo.push(child);
            }
        }
    }
    found
}

/// Sends `signal` to `pid`, panicking when that fails.
pub fn signal(pid: i32, signal: Signal) {
    kill(Pid::from_raw(pid), signal).unwrap_or_else(|e| panic!("kill -{signal} {pid}: {e}"));
}

/// Sends SIGKILL to `pid`, ignoring a process that is already gone.
pub fn kill9(pid: i32) {
    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
}

/// The proportional set size of `pid` in KiB (`Pss` of /proc/PID/smaps_rollup: each page
/// counted divided by how many processes map it), `None` when there is no such process.
pub fn pss_kib(pid: i32) -> Option<u64> {
    rollup_kib(pid, "Pss")
}

/// Field `field` of /proc/PID/smaps_rollup in KiB (`Pss`, `Pss_Anon`, `Pss_File`,
/// `Pss_Shmem`, `Rss`, ...), `None` when there is no such process or field.
pub fn rollup_kib(pid: i32, field: &str) -> Option<u64> {
    let rollup = fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let line = rollup.lines().find(|l| l.strip_prefix(field).is_some_and(|rest| rest.starts_with(':')))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// A field of `/proc/<pid>/status` (its value, trimmed), if the process and the field exist.
pub fn status_field(pid: i32, field: &str) -> Option<String> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| Some(l.strip_prefix(field)?.strip_prefix(':')?.trim().to_owned()))
}

/// A `kB` field of /proc/PID/status (VmRSS, VmHWM...), in bytes.
pub fn status_bytes(pid: i32, field: &str) -> Option<u64> {
    let kib: u64 = status_field(pid, field)?.split_whitespace().next()?.parse().ok()?;
    Some(kib << 10)
}

/// The kernel's transparent-huge-page mode, set to "always" while any of these lives (in this
/// test process) and put back as it was when the last is dropped.
pub struct HugePagesAlways(());

const THP_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// How many [`HugePagesAlways`] live, and the mode before the first.
static HUGE_PAGES_ALWAYS: std::sync::Mutex<(usize, String)> = std::sync::Mutex::new((0, String::new()));

impl HugePagesAlways {
    /// Sets the mode to "always" (as Debian's kernels default to): any private anonymous
    /// mapping's aligned 2 MiB may then be given a huge page on its first fault. `None` on a
    /// kernel without transparent huge pages.
    pub fn set() -> Option<HugePagesAlways> {
        if !Path::new(THP_ENABLED).exists() {
            eprintln!("no {THP_ENABLED}: this kernel has no transparent huge pages");
            return None;
        }
        let mut state = HUGE_PAGES_ALWAYS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if state.0 == 0 {
            state.1 = stasis_linux::proc::huge_pages_mode()
                .unwrap_or_else(|| panic!("{THP_ENABLED} names no current mode"));
            fs::write(THP_ENABLED, "always")
                .unwrap_or_else(|e| panic!("setting {THP_ENABLED} to always: {e}"));
        }
        state.0 += 1;
        Some(HugePagesAlways(()))
    }
}

impl Drop for HugePagesAlways {
    fn drop(&mut self) {
        let mut state = HUGE_PAGES_ALWAYS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        state.0 -= 1;
        if state.0 == 0
            && let Err(e) = fs::write(THP_ENABLED, &state.1)
        {
            eprintln!("putting {THP_ENABLED} back to {}: {e}", state.1);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_kb_field_of_status_reads_as_bytes() {
        let me = std::process::id() as i32;
        let rss = super::status_bytes(me, "VmRSS").expect("this process has a VmRSS");
        let kib: u64 = super::status_field(me, "VmRSS").unwrap().trim_end_matches(" kB").parse().unwrap();
        assert!(rss > 0 && rss.is_multiple_of(1024), "{rss}");
        assert!(rss.abs_diff(kib << 10) < 64 << 20, "{rss} against {kib} kB read just after");
        assert_eq!(super::status_bytes(me, "NoSuchField"), None);
    }
}
