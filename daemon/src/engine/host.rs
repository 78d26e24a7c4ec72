//! The kernel as the engine's jobs see it: processes, their state and signals, what a tree
//! holds, and its sockets' repair mode. [`LinuxHost`] does it through `linux/`; the unit tests
//! of the jobs' rollback paths use fakes, so those paths run without root, CRIU or a workload.

use std::collections::HashSet;
use std::io;

use nix::sys::signal::Signal;

use super::inspect::{self, TreeInfo};
use super::sockets::{self, Connection};
use crate::linux::proc::{self, ProcStat};

/// What the engine's jobs ask of the kernel.
pub trait Host: Send + Sync {
    /// Whether `pid` exists and is not a zombie.
    fn is_running(&self, pid: i32) -> bool;
    /// The command line of `pid`.
    fn command(&self, pid: i32) -> io::Result<Vec<String>>;
    /// What the tree rooted at `root` holds, and so how CRIU must dump it.
    fn inspect(&self, root: i32) -> io::Result<TreeInfo>;
    /// What `pid` is, if it may not be checkpointed at all: init, a kernel thread, or stasisd
    /// itself.
    fn untouchable(&self, pid: i32) -> Option<String>;
    /// Why CRIU cannot record the session of `pid`, if it cannot (session 0, whose leader is
    /// outside this pid namespace).
    fn unrecordable_session(&self, pid: i32) -> Option<String>;
    /// The pid of `pid` inside the pid namespace of which `root` is the init.
    fn pid_inside(&self, pid: i32, root: i32) -> Option<i32>;
    /// Resident memory of `pids` together.
    fn resident_bytes(&self, pids: &[i32]) -> u64;
    /// Which of `pids` are stopped (job control) now.
    fn stopped(&self, pids: &[i32]) -> Vec<i32>;
    /// Which of `pids` a process traces (a CRIU at work on them).
    fn traced(&self, pids: &[i32]) -> Vec<i32>;
    /// The roots of the tree that CRIU (process `criu`, or its launcher) is restoring, as far
    /// as they can be told before CRIU names them.
    fn restoring_roots(&self, criu: i32) -> Vec<i32>;
    /// Every process of the trees rooted at `roots`, roots first (children forked since a
    /// tree was inspected included).
    fn trees(&self, roots: &[i32]) -> Vec<i32>;
    /// Sends `signal` to each of `pids`, ignoring those that are gone.
    fn signal(&self, pids: &[i32], signal: Signal);
    /// When process `pid` started (clock ticks since boot): with the pid, it names one process,
    /// so a pid reused by another process can be told apart.
    fn start_time(&self, pid: i32) -> Option<u64>;
    /// Which of `pids` use CUDA, as far as their mappings and descriptors tell.
    fn cuda_candidates(&self, pids: &[i32]) -> Vec<i32>;
    /// Which of `pids` hold NVIDIA device files (open or mapped).
    fn nvidia_device_holders(&self, pids: &[i32]) -> Vec<i32>;
    /// Takes the TCP sockets of `pids` out of repair mode (see `sockets::leave_repair`).
    fn leave_repair(&self, pids: &[i32], reuse_addr: &HashSet<u64>) -> (Vec<Connection>, Vec<String>);
    /// The CPU's user-space instruction-set extensions (see `proc::cpu_isa_flags`).
    fn cpu_flags(&self) -> std::collections::BTreeSet<String>;
    /// This node's name and kernel release, for manifests.
    fn node_name(&self) -> String;
    fn kernel_release(&self) -> String;
}

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

    fn inspect(&self, root: i32) -> io::Result<TreeInfo> {
        inspect::inspect(root)
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

    fn stopped(&self, pids: &[i32]) -> Vec<i32> {
        pids.iter().copied().filter(|p| ProcStat::read(*p).is_ok_and(|s| s.is_stopped())).collect()
    }

    fn traced(&self, pids: &[i32]) -> Vec<i32> {
        pids.iter().copied().filter(|p| proc::tracer(*p).is_some()).collect()
    }

    fn restoring_roots(&self, criu: i32) -> Vec<i32> {
        proc::restoring_namespace_root(criu).into_iter().chain(proc::restored_root_under(criu)).collect()
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

    fn cuda_candidates(&self, pids: &[i32]) -> Vec<i32> {
        crate::cuda::cuda_candidates(pids)
    }

    fn nvidia_device_holders(&self, pids: &[i32]) -> Vec<i32> {
        crate::cuda::nvidia_device_holders(pids)
    }

    fn leave_repair(&self, pids: &[i32], reuse_addr: &HashSet<u64>) -> (Vec<Connection>, Vec<String>) {
        sockets::leave_repair(pids, reuse_addr)
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

#[cfg(test)]
pub(super) mod fake {
    //! A kernel of made-up processes that records what it is asked to do.

    use std::collections::{HashMap, HashSet};
    use std::io;
    use std::sync::Mutex;

    use nix::sys::signal::Signal;

    use super::Host;
    use crate::engine::inspect::TreeInfo;
    use crate::engine::sockets::Connection;

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
        /// Every signal sent, in order.
        pub signals: Mutex<Vec<(i32, Signal)>>,
        /// Calls of `leave_repair`.
        pub repairs: Mutex<usize>,
        /// Pids now held by another process than the one inspected (a start time of 2, not 1).
        pub reused: Mutex<HashSet<i32>>,
        /// The CPU's instruction-set extensions.
        pub cpu_flags: Mutex<std::collections::BTreeSet<String>>,
    }

    impl FakeHost {
        /// A host running the tree `info`.
        pub fn with_tree(info: TreeInfo) -> FakeHost {
            let host = FakeHost::default();
            host.running.lock().unwrap().extend(info.pids.iter().copied());
            host.trees.lock().unwrap().insert(info.pids[0], info);
            host
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

        fn inspect(&self, root: i32) -> io::Result<TreeInfo> {
            self.trees
                .lock()
                .unwrap()
                .get(&root)
                .cloned()
                .ok_or_else(|| io::Error::from_raw_os_error(libc::ESRCH))
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

        fn cuda_candidates(&self, pids: &[i32]) -> Vec<i32> {
            pids.iter().copied().filter(|p| self.cuda.contains(p)).collect()
        }

        fn nvidia_device_holders(&self, pids: &[i32]) -> Vec<i32> {
            self.cuda_candidates(pids)
        }

        fn leave_repair(&self, _pids: &[i32], _reuse_addr: &HashSet<u64>) -> (Vec<Connection>, Vec<String>) {
            *self.repairs.lock().unwrap() += 1;
            (Vec::new(), Vec::new())
        }

        fn cpu_flags(&self) -> std::collections::BTreeSet<String> {
            self.cpu_flags.lock().unwrap().clone()
        }

        fn node_name(&self) -> String {
            "fake-node".into()
        }

        fn kernel_release(&self) -> String {
            "6.18.0-fake".into()
        }
    }
}
