//! A kernel of made-up processes that records what it is asked to do.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use nix::sys::signal::Signal;

use super::fake_containers::FakeContainers;
use super::fake_faults::FakeFaults;
use super::fake_locks::FakeLocks;
use super::fake_programs::FakePrograms;
use super::{Hold, Host, PortUses, TcpSockets, Usage, Watches};
use crate::engine::inspect::TreeInfo;
use crate::engine::sockets::{Connection, TreeSockets};
use crate::linux::net::SocketEntry;
use crate::linux::net::SocketTable;
use crate::linux::net::WaitingInput;
use crate::linux::sock_diag::TcpSocketInfo;
use crate::linux::sys::ChildSetup;

/// Where the fake's cgroup v2 hierarchy is.
const CGROUP_ROOT: &str = "/fake/cgroup";

/// Holds on new connections made: the ports of each, and whether it is still in place.
type Holds = Arc<Mutex<Vec<(Vec<u16>, bool)>>>;

/// Address ranges, `[start, end)`.
type Ranges = Vec<(u64, u64)>;

#[derive(Debug, Default)]
pub struct FakeHost {
    /// The trees `inspect` answers with, by root.
    pub trees: Mutex<HashMap<i32, TreeInfo>>,
    /// Processes that exist; `signal(SIGKILL)` removes them.
    pub running: Mutex<HashSet<i32>>,
    /// Processes stopped now (SIGSTOP'ed by the fake CRIU, or before).
    pub stopped: Mutex<HashSet<i32>>,
    /// Processes with CUDA loaded.
    pub cuda: Vec<i32>,
    /// Processes holding NVIDIA device files whatever their CUDA state (none by default: a
    /// CUDA process's go with its checkpoint).
    pub device_holders: Mutex<Vec<i32>>,
    /// Input the tree's sockets hold and it has not taken, as each question in turn finds it;
    /// the last answer stays (none by default).
    pub waiting_input: Mutex<Vec<Vec<WaitingInput>>>,
    /// Files processes hold that their user may not open (none by default).
    pub foreign_files: Mutex<HashMap<i32, Vec<String>>>,
    /// Every signal sent, in order.
    pub signals: Mutex<Vec<(i32, Signal)>>,
    /// Calls of `leave_repair`.
    pub repairs: Mutex<usize>,
    /// The connections in TCP repair mode (CRIU left them so): `leave_repair` reopens them.
    pub in_repair: Mutex<Vec<Connection>>,
    /// The network locks CRIU left, and what was done to remove them (see fake_locks.rs).
    pub locks: FakeLocks,
    /// Kubernetes containers (see fake_containers.rs).
    pub containers: FakeContainers,
    /// What the processes run, and the kernel release (see fake_programs.rs).
    pub programs: FakePrograms,
    /// Pids now held by another process than the one inspected (a start time of 2, not 1).
    pub reused: Mutex<HashSet<i32>>,
    /// The CPU's instruction-set extensions.
    pub cpu_flags: Mutex<std::collections::BTreeSet<String>>,
    /// What `private_writable_ranges` answers for a pid, one answer per call (the last one
    /// repeats): a CUDA checkpoint adds a range between two calls.
    pub private_ranges: Mutex<HashMap<i32, VecDeque<Ranges>>>,
    /// What each process has used so far (nothing, for those not listed).
    pub usage: Mutex<HashMap<i32, Usage>>,
    /// The workload cgroups that exist, and the processes in each.
    pub cgroups: Mutex<HashMap<PathBuf, Vec<i32>>>,
    /// The cgroups whose `cgroup.procs` was opened since the last spawn: the next child
    /// joins them.
    pub joining: Mutex<Vec<PathBuf>>,
    /// Every command spawned: its program and arguments.
    pub spawned: Mutex<Vec<Vec<String>>>,
    /// The sockets of this network namespace by inode, each with the pid that holds it.
    pub namespace_sockets: Mutex<HashMap<u64, (SocketEntry, i32)>>,
    /// The sockets every tree holds.
    pub sockets: Mutex<TreeSockets>,
    /// The port a segment arrives for once a port watch has been in place for
    /// `segment_after` (else none comes).
    pub segment: Mutex<Option<u16>>,
    pub segment_after: Mutex<std::time::Duration>,
    /// The ports of each hold on new connections made, and whether it is still in place.
    pub holds: Holds,
    /// The userfaultfds of lazily restored memory (see fake_faults.rs).
    pub faults: Arc<FakeFaults>,
    /// stasisd's helper programs installed (none unless a test installs one), by name.
    pub helpers: Mutex<HashMap<&'static str, PathBuf>>,
    /// The methods that fail (by name), with `EACCES`.
    pub failing: Mutex<HashSet<&'static str>>,
}

impl FakeHost {
    /// A host running the tree `info`.
    pub fn with_tree(info: TreeInfo) -> FakeHost {
        let host = FakeHost::default();
        host.running.lock().unwrap().extend(info.pids.iter().copied());
        host.trees.lock().unwrap().insert(info.pids[0], info);
        host
    }

    /// Makes method `name` fail from now on.
    pub fn fail(&self, name: &'static str) {
        self.failing.lock().unwrap().insert(name);
    }

    /// `EACCES` if method `name` fails.
    pub(super) fn check(&self, name: &'static str) -> io::Result<()> {
        match self.failing.lock().unwrap().contains(name) {
            true => Err(io::Error::from_raw_os_error(libc::EACCES)),
            false => Ok(()),
        }
    }

    pub fn signals_of(&self, signal: Signal) -> Vec<i32> {
        self.signals.lock().unwrap().iter().filter(|(_, s)| *s == signal).map(|(p, _)| *p).collect()
    }
}

impl Host for FakeHost {
    fn is_running(&self, pid: i32) -> bool {
        self.running.lock().unwrap().contains(&pid)
    }

    fn command(&self, pid: i32) -> io::Result<Vec<String>> {
        Ok(vec![format!("fake-{pid}")])
    }

    fn survey_tree(&self, root: i32) -> io::Result<TreeInfo> {
        self.trees
            .lock()
            .unwrap()
            .get(&root)
            .cloned()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ESRCH))
    }

    fn mapped_files(&self, pid: i32) -> Vec<String> {
        self.programs.mapped(pid)
    }

    fn initial_environment(&self, pid: i32) -> Option<Vec<String>> {
        self.programs.environment(pid)
    }

    fn untouchable(&self, pid: i32) -> Option<String> {
        (pid == 1).then(|| "init".into())
    }

    fn unrecordable_session(&self, _pid: i32) -> Option<String> {
        None
    }

    fn pid_inside(&self, pid: i32, _root: i32) -> Option<i32> {
        Some(pid)
    }

    fn resident_bytes(&self, pids: &[i32]) -> u64 {
        pids.len() as u64 * (64 << 20)
    }

    fn private_writable_ranges(&self, pid: i32) -> Vec<(u64, u64)> {
        let mut answers = self.private_ranges.lock().unwrap();
        let Some(answers) = answers.get_mut(&pid) else { return Vec::new() };
        match answers.len() {
            0 | 1 => answers.front().cloned().unwrap_or_default(),
            _ => answers.pop_front().unwrap_or_default(),
        }
    }

    fn usage(&self, pid: i32) -> Usage {
        self.usage.lock().unwrap().get(&pid).copied().unwrap_or_default()
    }

    fn memory_total(&self) -> Option<u64> {
        Some(16 << 30)
    }

    fn stopped(&self, pids: &[i32]) -> Vec<i32> {
        let stopped = self.stopped.lock().unwrap();
        pids.iter().copied().filter(|p| stopped.contains(p)).collect()
    }

    fn traced(&self, _pids: &[i32]) -> Vec<i32> {
        Vec::new()
    }

    fn restoring_roots(&self, _criu: i32) -> Vec<i32> {
        Vec::new()
    }

    fn working_dirs(&self) -> Vec<(i32, PathBuf)> {
        Vec::new()
    }

    fn restoring_namespace_root(&self, _criu: i32) -> Option<i32> {
        None
    }

    fn restored_root_under(&self, _launcher: i32) -> Option<i32> {
        None
    }

    fn process_tree(&self, root: i32) -> io::Result<Vec<i32>> {
        let trees = self.trees.lock().unwrap();
        trees.get(&root).map(|t| t.pids.clone()).ok_or_else(|| io::Error::from_raw_os_error(libc::ESRCH))
    }

    fn trees(&self, roots: &[i32]) -> Vec<i32> {
        let trees = self.trees.lock().unwrap();
        let mut all: Vec<i32> = roots.to_vec();
        for root in roots {
            all.extend(trees.get(root).map(|t| t.pids.clone()).unwrap_or_default());
        }
        // A reused pid is another process's now, no descendant of the tree.
        let reused = self.reused.lock().unwrap();
        let mut seen = HashSet::new();
        all.retain(|p| seen.insert(*p) && (roots.contains(p) || !reused.contains(p)));
        all
    }

    fn signal(&self, pids: &[i32], signal: Signal) {
        for &pid in pids {
            self.signals.lock().unwrap().push((pid, signal));
            match signal {
                Signal::SIGKILL => {
                    self.running.lock().unwrap().remove(&pid);
                }
                Signal::SIGCONT => {
                    self.stopped.lock().unwrap().remove(&pid);
                }
                _ => {}
            }
        }
    }

    fn start_time(&self, pid: i32) -> Option<u64> {
        match (self.running.lock().unwrap().contains(&pid), self.reused.lock().unwrap().contains(&pid)) {
            (_, true) => Some(2),
            (true, false) => Some(1),
            (false, false) => None,
        }
    }

    /// Fake processes have no memory to read: a dump reads back from the previous checkpoint.
    fn read_memory(&self, pid: i32, _addr: u64, _len: usize) -> io::Result<Vec<u8>> {
        Err(io::Error::new(io::ErrorKind::Unsupported, format!("fake process {pid} has no memory")))
    }

    fn cuda_candidates(&self, pids: &[i32]) -> Vec<i32> {
        pids.iter().copied().filter(|p| self.cuda.contains(p)).collect()
    }

    fn nvidia_device_holders(&self, pids: &[i32]) -> Vec<i32> {
        let holders = self.device_holders.lock().unwrap();
        pids.iter().copied().filter(|p| holders.contains(p)).collect()
    }

    fn files_its_user_may_not_open(
        &self,
        pid: i32,
        _exempt: &HashSet<(u64, u64)>,
    ) -> io::Result<Vec<String>> {
        Ok(self.foreign_files.lock().unwrap().get(&pid).cloned().unwrap_or_default())
    }

    fn sockets(&self, _pids: &[i32]) -> TreeSockets {
        self.sockets.lock().unwrap().clone()
    }

    fn waiting_input(&self, _pids: &[i32]) -> Vec<WaitingInput> {
        let mut answers = self.waiting_input.lock().unwrap();
        if answers.len() > 1 { answers.remove(0) } else { answers.first().cloned().unwrap_or_default() }
    }

    fn socket_table(&self) -> SocketTable {
        let sockets = self.namespace_sockets.lock().unwrap();
        SocketTable { by_inode: sockets.iter().map(|(inode, (entry, _))| (*inode, entry.clone())).collect() }
    }

    fn socket_holders(&self, inode: u64) -> Vec<(i32, String)> {
        let sockets = self.namespace_sockets.lock().unwrap();
        sockets.get(&inode).map(|(_, pid)| (*pid, format!("fake-{pid}"))).into_iter().collect()
    }

    fn leave_repair(&self, _pids: &[i32], _reuse_addr: &HashSet<u64>) -> (Vec<Connection>, Vec<String>) {
        *self.repairs.lock().unwrap() += 1;
        (std::mem::take(&mut *self.in_repair.lock().unwrap()), Vec::new())
    }

    fn cgroup_root(&self, _path: &Path) -> Option<i32> {
        None
    }

    fn remove_empty_cgroup(&self, path: &Path) {
        let running = self.running.lock().unwrap();
        self.cgroups.lock().unwrap().retain(|p, pids| p != path || pids.iter().any(|p| running.contains(p)));
    }

    fn create_cgroup(&self, daemon: &str, workload: &str) -> io::Result<Option<PathBuf>> {
        self.check("create_cgroup")?;
        let path = Path::new(CGROUP_ROOT).join("stasis").join(daemon).join(workload);
        self.cgroups.lock().unwrap().entry(path.clone()).or_default();
        Ok(Some(path))
    }

    fn cgroup_in_hierarchy(&self, path: &Path) -> Option<String> {
        Some(format!("/{}", path.strip_prefix(CGROUP_ROOT).ok()?.display()))
    }

    fn open_cgroup_procs(&self, path: &Path) -> io::Result<File> {
        self.check("open_cgroup_procs")?;
        self.joining.lock().unwrap().push(path.to_path_buf());
        File::options().write(true).open("/dev/null")
    }

    /// Starts the tree the fake holds (the one of the lowest root): the child is its root.
    fn spawn(&self, cmd: &mut Command, _setup: ChildSetup) -> io::Result<i32> {
        let joining = std::mem::take(&mut *self.joining.lock().unwrap());
        self.check("spawn")?;
        let argv = std::iter::once(cmd.get_program()).chain(cmd.get_args());
        self.spawned.lock().unwrap().push(argv.map(|a| a.to_string_lossy().into_owned()).collect());
        let trees = self.trees.lock().unwrap();
        let tree = trees.values().min_by_key(|t| t.pids[0]).ok_or(io::ErrorKind::NotFound)?;
        self.running.lock().unwrap().extend(tree.pids.iter().copied());
        let mut cgroups = self.cgroups.lock().unwrap();
        for path in joining {
            cgroups.entry(path).or_default().push(tree.pids[0]);
        }
        Ok(tree.pids[0])
    }

    fn init_program(&self) -> io::Result<PathBuf> {
        self.check("init_program")?;
        Ok("/fake/stasis-init".into())
    }

    fn install_init_programs(&self, _images: &Path) -> io::Result<()> {
        self.check("install_init_programs")
    }

    fn terminal_to_log(&self, _log: &Path) -> io::Result<OwnedFd> {
        self.check("terminal_to_log")?;
        Ok(File::open("/dev/null")?.into())
    }

    fn companion_program(&self, name: &str) -> io::Result<PathBuf> {
        self.helpers.lock().unwrap().get(name).cloned().ok_or_else(|| io::ErrorKind::NotFound.into())
    }

    fn find_program(&self, _name: &str) -> Option<PathBuf> {
        None
    }

    fn userfaultfd_events(&self) -> Result<(), String> {
        Ok(())
    }

    fn soft_dirty(&self) -> Result<(), String> {
        Ok(())
    }

    fn huge_pages_mode(&self) -> Option<String> {
        Some("madvise".into())
    }

    fn pidfd_getfd(&self) -> Result<(), String> {
        Ok(())
    }

    fn criu_kernel_cache(&self) -> Result<(), String> {
        Ok(())
    }

    fn cpu_flags(&self) -> std::collections::BTreeSet<String> {
        self.cpu_flags.lock().unwrap().clone()
    }

    fn node_name(&self) -> String {
        "fake-node".into()
    }

    fn kernel_release(&self) -> String {
        self.programs.release()
    }
}

impl Watches for FakeHost {
    fn watch_ports(&self, _ports: &[u16]) -> io::Result<Box<dyn PortUses>> {
        self.check("watch_ports")?;
        Ok(Box::new(FakePortWatch(*self.segment.lock().unwrap(), *self.segment_after.lock().unwrap())))
    }

    fn tcp_sockets(&self) -> io::Result<Box<dyn TcpSockets>> {
        self.check("tcp_sockets")?;
        Ok(Box::new(NoPeers))
    }

    fn hold_new_connections(&self, _name: &str, ports: &[u16]) -> io::Result<Hold> {
        self.check("hold_new_connections")?;
        let mut holds = self.holds.lock().unwrap();
        holds.push((ports.to_vec(), true));
        Ok(Box::new(FakeHold { holds: self.holds.clone(), at: holds.len() - 1 }))
    }
}

/// A port watch that sees one segment, for the port it holds, after the time it holds; or
/// none.
struct FakePortWatch(Option<u16>, std::time::Duration);

#[async_trait::async_trait]
impl PortUses for FakePortWatch {
    async fn next(&self) -> io::Result<u16> {
        match self.0 {
            Some(port) => {
                tokio::time::sleep(self.1).await;
                Ok(port)
            }
            None => std::future::pending().await,
        }
    }
}

/// A network namespace without the peers of any connection.
struct NoPeers;

impl TcpSockets for NoPeers {
    fn tcp(&mut self, _local: SocketAddr, _remote: SocketAddr) -> io::Result<Option<TcpSocketInfo>> {
        Ok(None)
    }
}

/// Hold `at` of `holds`, no longer in place once dropped.
struct FakeHold {
    holds: Holds,
    at: usize,
}

impl Drop for FakeHold {
    fn drop(&mut self) {
        self.holds.lock().unwrap()[self.at].1 = false;
    }
}
