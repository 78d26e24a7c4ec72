//! [`Host`] on the real kernel: each answer comes from `linux/` (or, for what a tree holds
//! and its sockets, from `inspect` and `sockets`, which read it there).

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use async_trait::async_trait;
use nix::sys::signal::Signal;

use super::container_cuda::ContainerCuda;
use super::{
    Containers, FaultEvent, FaultFd, Hold, Host, NetworkLocks, PortUses, TcpSockets, Usage, Userfaults,
    Watches,
};
use crate::cuda::GpuCheckpointer;
use crate::engine::inspect::{self, TreeInfo};
use crate::engine::sockets::{self, Connection, TreeSockets};
use crate::linux::cgroup::{self, WorkloadCgroup};
use crate::linux::net::{self, SocketTable, WaitingInput};
use crate::linux::port_watch::PortWatch;
use crate::linux::proc::{self, ProcStat};
use crate::linux::reaper::{ExitKind, Reaper};
use crate::linux::sock_diag::{SockDiag, TcpSocketInfo};
use crate::linux::syn_hold::SynHold;
use crate::linux::sys::{self, ChildSetup};
use crate::linux::uffd::{self, FillError, Userfaultfd};
use crate::linux::{container, init_program, nft, pty};

/// The real kernel.
#[derive(Debug, Default, Clone, Copy)]
pub struct LinuxHost;

impl Host for LinuxHost {
    fn is_running(&self, pid: i32) -> bool {
        proc::is_running(pid)
    }

    fn command(&self, pid: i32) -> io::Result<Vec<String>> {
        proc::cmdline(pid)
    }

    fn survey_tree(&self, root: i32) -> io::Result<TreeInfo> {
        inspect::inspect(root)
    }

    fn mapped_files(&self, pid: i32) -> Vec<String> {
        proc::mapped_paths(pid)
    }

    fn initial_environment(&self, pid: i32) -> Option<Vec<String>> {
        inspect::initial_environment(pid)
    }

    fn untouchable(&self, pid: i32) -> Option<String> {
        if pid == 1 {
            return Some("init, the system's first process".into());
        }
        if pid == std::process::id() as i32 {
            return Some("stasisd itself".into());
        }
        let stat = ProcStat::read(pid).ok()?;
        stat.is_kernel_thread().then(|| format!("a kernel thread ({})", stat.comm))
    }

    fn unrecordable_session(&self, pid: i32) -> Option<String> {
        // Session 0: the leader is outside this pid namespace (or the process descends from an
        // init that never started a session), and CRIU has no way to record it.
        (ProcStat::read(pid).ok()?.session == 0).then(|| {
            "in session 0, whose leader is outside this pid namespace, so CRIU cannot record it; \
             start it in a session of its own (setsid(1), or `stasis run`)"
                .into()
        })
    }

    fn pid_inside(&self, pid: i32, root: i32) -> Option<i32> {
        proc::pid_inside(pid, root)
    }

    fn resident_bytes(&self, pids: &[i32]) -> u64 {
        pids.iter().map(|&pid| proc::resident_bytes(pid)).sum()
    }

    fn private_writable_ranges(&self, pid: i32) -> Vec<(u64, u64)> {
        proc::private_writable_ranges(pid).unwrap_or_default()
    }

    fn usage(&self, pid: i32) -> Usage {
        Usage { cpu_ns: proc::cpu_time_ns(pid).unwrap_or(0), read_bytes: proc::read_chars(pid).unwrap_or(0) }
    }

    fn memory_total(&self) -> Option<u64> {
        proc::memory_total()
    }

    fn stopped(&self, pids: &[i32]) -> Vec<i32> {
        pids.iter().copied().filter(|p| ProcStat::read(*p).is_ok_and(|s| s.is_stopped())).collect()
    }

    fn traced(&self, pids: &[i32]) -> Vec<i32> {
        pids.iter().copied().filter(|p| proc::tracer(*p).is_some()).collect()
    }

    fn restoring_roots(&self, criu: i32) -> Vec<i32> {
        proc::restoring_namespace_root(criu).into_iter().chain(proc::restored_root_under(criu)).collect()
    }

    fn working_dirs(&self) -> Vec<(i32, PathBuf)> {
        // The kernel names a removed directory "<path> (deleted)".
        let had = |cwd: PathBuf| match cwd.to_str().and_then(|c| c.strip_suffix(" (deleted)")) {
            Some(path) => PathBuf::from(path),
            None => cwd,
        };
        let root = |p: i32| proc::uids(p).is_ok_and(|[real, effective, ..]| real == 0 && effective == 0);
        proc::all_pids()
            .into_iter()
            .filter(|&p| root(p))
            .filter_map(|p| Some((p, had(proc::cwd(p).ok()?))))
            .collect()
    }

    fn restoring_namespace_root(&self, criu: i32) -> Option<i32> {
        proc::restoring_namespace_root(criu)
    }

    fn restored_root_under(&self, launcher: i32) -> Option<i32> {
        proc::restored_root_under(launcher)
    }

    fn process_tree(&self, root: i32) -> io::Result<Vec<i32>> {
        proc::process_tree(root)
    }

    fn trees(&self, roots: &[i32]) -> Vec<i32> {
        let mut all: Vec<i32> = roots.to_vec();
        for root in roots {
            all.extend(proc::process_tree(*root).unwrap_or_default());
        }
        let mut seen = HashSet::new();
        all.retain(|p| seen.insert(*p));
        all
    }

    fn signal(&self, pids: &[i32], signal: Signal) {
        proc::signal_all(pids, signal);
    }

    fn start_time(&self, pid: i32) -> Option<u64> {
        ProcStat::read(pid).ok()?.start_time
    }

    fn read_memory(&self, pid: i32, addr: u64, len: usize) -> io::Result<Vec<u8>> {
        sys::read_memory(pid, addr, len)
    }

    fn cuda_candidates(&self, pids: &[i32]) -> Vec<i32> {
        crate::cuda::cuda_candidates(pids)
    }

    fn nvidia_device_holders(&self, pids: &[i32]) -> Vec<i32> {
        crate::cuda::nvidia_device_holders(pids)
    }

    fn files_its_user_may_not_open(&self, pid: i32, exempt: &HashSet<(u64, u64)>) -> io::Result<Vec<String>> {
        crate::linux::owner_access::files_its_user_may_not_open(pid, exempt)
    }

    fn sockets(&self, pids: &[i32]) -> TreeSockets {
        sockets::survey(pids)
    }

    fn waiting_input(&self, pids: &[i32]) -> Vec<WaitingInput> {
        net::waiting_input(pids)
    }

    fn socket_table(&self) -> SocketTable {
        SocketTable::own()
    }

    fn socket_holders(&self, inode: u64) -> Vec<(i32, String)> {
        net::socket_holders(inode)
    }

    fn leave_repair(&self, pids: &[i32], reuse_addr: &HashSet<u64>) -> (Vec<Connection>, Vec<String>) {
        sockets::leave_repair(pids, reuse_addr)
    }

    fn cgroup_root(&self, path: &Path) -> Option<i32> {
        WorkloadCgroup { path: path.to_path_buf() }.root_process()
    }

    fn remove_empty_cgroup(&self, path: &Path) {
        WorkloadCgroup { path: path.to_path_buf() }.remove_if_empty();
    }

    fn create_cgroup(&self, daemon: &str, workload: &str) -> io::Result<Option<PathBuf>> {
        cgroup::v2_root().map(|root| Ok(WorkloadCgroup::create(&root, daemon, workload)?.path)).transpose()
    }

    fn cgroup_in_hierarchy(&self, path: &Path) -> Option<String> {
        cgroup::hierarchy_path(path)
    }

    fn open_cgroup_procs(&self, path: &Path) -> io::Result<File> {
        WorkloadCgroup { path: path.to_path_buf() }.open_procs()
    }

    fn spawn(&self, cmd: &mut Command, setup: ChildSetup) -> io::Result<i32> {
        sys::spawn(cmd, setup).map(|child| child.id() as i32)
    }

    fn init_program(&self) -> io::Result<PathBuf> {
        init_program::install()
    }

    fn install_init_programs(&self, images: &Path) -> io::Result<()> {
        init_program::install_from(images)
    }

    fn terminal_to_log(&self, log: &Path) -> io::Result<OwnedFd> {
        pty::terminal_to_log(log)
    }

    fn companion_program(&self, name: &str) -> io::Result<PathBuf> {
        crate::linux::companion_program(name)
    }

    fn find_program(&self, name: &str) -> Option<PathBuf> {
        crate::linux::find_program(name)
    }

    fn userfaultfd_events(&self) -> Result<(), String> {
        Userfaultfd::open(uffd::EVENT_FEATURES)
            .map(drop)
            .map_err(|e| format!("this kernel gives no userfaultfd with fork, remap and unmap events ({e})"))
    }

    fn soft_dirty(&self) -> Result<(), String> {
        proc::soft_dirty()
    }

    fn huge_pages_mode(&self) -> Option<String> {
        proc::huge_pages_mode()
    }

    fn pidfd_getfd(&self) -> Result<(), String> {
        sys::pidfd_getfd_works().map_err(|e| format!("pidfd_getfd(2) fails ({e}; it needs Linux 5.6)"))
    }

    fn criu_kernel_cache(&self) -> Result<(), String> {
        match crate::linux::on_tmpfs(Path::new("/run")) {
            Ok(true) => Ok(()),
            Ok(false) => Err("/run is not a tmpfs".into()),
            Err(e) => Err(format!("cannot tell what /run is ({e})")),
        }
    }

    fn cpu_flags(&self) -> std::collections::BTreeSet<String> {
        proc::cpu_isa_flags()
    }

    fn node_name(&self) -> String {
        proc::node_name()
    }

    fn kernel_release(&self) -> String {
        proc::kernel_release()
    }
}

impl Watches for LinuxHost {
    fn watch_ports(&self, ports: &[u16]) -> io::Result<Box<dyn PortUses>> {
        Ok(Box::new(PortWatch::open(ports)?))
    }

    fn tcp_sockets(&self) -> io::Result<Box<dyn TcpSockets>> {
        Ok(Box::new(SockDiag::open()?))
    }

    fn hold_new_connections(&self, name: &str, ports: &[u16]) -> io::Result<Hold> {
        Ok(Box::new(SynHold::hold(name, ports)?))
    }
}

#[async_trait]
impl PortUses for PortWatch {
    async fn next(&self) -> io::Result<u16> {
        PortWatch::next(self).await
    }
}

impl TcpSockets for SockDiag {
    fn tcp(&mut self, local: SocketAddr, remote: SocketAddr) -> io::Result<Option<TcpSocketInfo>> {
        SockDiag::tcp(self, local, remote)
    }
}

#[async_trait]
impl NetworkLocks for LinuxHost {
    fn delete_inet_table(&self, name: &str) -> io::Result<bool> {
        nft::delete_inet_table(name)
    }

    async fn run_iptables(&self, reaper: &Reaper, cmd: Command) -> io::Result<(ExitKind, String)> {
        reaper.run(cmd).await
    }
}

#[async_trait]
impl Containers for LinuxHost {
    fn is_namespace_init(&self, pid: i32) -> bool {
        proc::is_namespace_init(pid)
    }

    fn pid_namespace(&self, pid: i32) -> io::Result<u64> {
        container::pid_namespace(pid)
    }

    fn children(&self, pid: i32) -> Vec<i32> {
        proc::children(pid).unwrap_or_default()
    }

    fn threads(&self, pid: i32) -> Vec<i32> {
        proc::threads(pid)
    }

    fn fd_target(&self, pid: i32, fd: i32) -> io::Result<String> {
        container::fd_target(pid, fd)
    }

    fn copy_fd_of(&self, pid: i32, fd: i32) -> io::Result<OwnedFd> {
        sys::copy_fd_of(pid, fd)
    }

    fn ensure_tmp(&self, pid: i32) -> io::Result<()> {
        container::ensure_tmp(pid)
    }

    fn cgroup_procs_files(&self, pid: i32) -> io::Result<Vec<PathBuf>> {
        container::cgroup_procs_files(pid)
    }

    async fn reserve_pids(&self, reaper: &Reaper, init: i32, highest: i32, needed: &[i32]) -> io::Result<()> {
        container::reserve_pids(reaper, init, highest, needed).await
    }

    fn cuda_in(&self, reaper: &Reaper, init: i32) -> Arc<dyn GpuCheckpointer> {
        Arc::new(ContainerCuda::new(reaper.clone(), init))
    }
}

impl Userfaults for LinuxHost {
    fn adopt_userfaultfd(&self, fd: OwnedFd) -> io::Result<Box<dyn FaultFd>> {
        Ok(Box::new(Userfaultfd::from_fd(fd)?))
    }
}

impl FaultFd for Userfaultfd {
    fn read_events(&self, out: &mut Vec<FaultEvent>) -> io::Result<()> {
        let mut events = Vec::new();
        let read = Userfaultfd::read_events(self, &mut events);
        out.extend(events.into_iter().map(|e| e.map_child(|child| Box::new(child) as Box<dyn FaultFd>)));
        read
    }

    fn register(&self, start: u64, len: u64) -> io::Result<()> {
        Userfaultfd::register(self, start, len)
    }

    fn copy(&self, dst: u64, src: &[u8]) -> Result<(), FillError> {
        Userfaultfd::copy(self, dst, src)
    }

    fn zero(&self, dst: u64, len: u64) -> Result<(), FillError> {
        Userfaultfd::zero(self, dst, len)
    }

    fn wake(&self, start: u64, len: u64) -> io::Result<()> {
        Userfaultfd::wake(self, start, len)
    }
}
