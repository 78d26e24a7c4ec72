//! The stopped tree's memory, which the page server reads the unchanged pages of mixed windows
//! from while CRIU dumps it (`stasis_store::TreeMemory`, see the store's `tree_pages.rs`).
//!
//! CRIU names a process's memory image by the pid it has in the tree's own pid namespace;
//! stasisd reads memory by the pid it has here. The reads are of the processes that were
//! inspected: once the last is done, each process read from must still have the start time it
//! had then (a pid reused meanwhile would not), or the store refuses the dump; and the store
//! takes an image's reads only once one of its written pages read here matched what CRIU sent.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::super::host::Host;
use super::super::inspect::TreeInfo;
use crate::criu::images::task_of;
use crate::store::TreeMemory;

pub(super) struct FrozenMemory {
    host: Arc<dyn Host>,
    /// Each process by its pid in CRIU's images: its pid here, when it started, and whether
    /// it was read from.
    processes: HashMap<u64, (i32, u64, AtomicBool)>,
}

impl FrozenMemory {
    /// The memory of `tree`'s processes, as inspected before its dump.
    pub(super) fn of(host: Arc<dyn Host>, tree: &TreeInfo) -> Self {
        // In a pid namespace of its own, CRIU's images give its processes the pids they have
        // there; else the pids they have here.
        let image_pids = if tree.ns_pids.len() == tree.pids.len() { &tree.ns_pids } else { &tree.pids };
        let processes = tree
            .pids
            .iter()
            .zip(image_pids)
            .filter_map(|(&pid, &image_pid)| {
                Some((
                    u64::try_from(image_pid).ok()?,
                    (pid, *tree.started.get(&pid)?, AtomicBool::new(false)),
                ))
            })
            .collect();
        FrozenMemory { host, processes }
    }
}

impl TreeMemory for FrozenMemory {
    fn read(&self, dst_id: u64, addr: u64, len: usize) -> Option<Vec<u8>> {
        let (pid, _, read) = self.processes.get(&task_of(dst_id)?)?;
        let bytes = self.host.read_memory(*pid, addr, len).ok()?;
        read.store(true, Ordering::Relaxed);
        Some(bytes)
    }

    fn still_the_same(&self) -> bool {
        self.processes.values().all(|(pid, started, read)| {
            !read.load(Ordering::Relaxed) || self.host.start_time(*pid) == Some(*started)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::host::LinuxHost;

    #[test]
    fn a_process_is_found_by_its_image_pid_and_a_reused_pid_is_found_out() {
        let page = vec![0x5au8; 4096];
        let (pid, addr) = (std::process::id() as i32, page.as_ptr() as u64);
        let host: Arc<dyn Host> = Arc::new(LinuxHost);
        let started = host.start_time(pid).unwrap();
        let inspected = crate::engine::inspect::inspect(pid).unwrap();
        let tree = |ns_pids: Vec<i32>, started: u64| TreeInfo {
            pids: vec![pid],
            ns_pids,
            started: HashMap::from([(pid, started)]),
            ..inspected.clone()
        };
        let image = |id: i32| ((id as u64) << 8) | 1;

        let memory = FrozenMemory::of(host.clone(), &tree(Vec::new(), started));
        assert_eq!(memory.read(image(pid), addr, 4096), Some(page.clone()));
        assert_eq!(memory.read((image(pid) & !0xff) | 2, addr, 4096), None, "shared memory is not a task's");
        assert!(memory.still_the_same());
        // In a pid namespace of its own, the tree's root is 1 there.
        let memory = FrozenMemory::of(host.clone(), &tree(vec![1], started));
        assert_eq!(memory.read(image(1), addr, 16), Some(page[..16].to_vec()));
        assert_eq!(memory.read(image(pid), addr, 16), None);
        // Another process now has the pid: found out once read from.
        let memory = FrozenMemory::of(host, &tree(Vec::new(), started + 1));
        assert!(memory.still_the_same(), "nothing read yet");
        memory.read(image(pid), addr, 16);
        assert!(!memory.still_the_same());
    }
}
