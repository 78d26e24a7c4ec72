//! A fake dump's images, for the unit tests here and, with the `testing` feature, those of the
//! crates that handle dumps (the CRIU driver's fake, the store).

use std::path::Path;

use prost::Message;
use stasis_proto::criu::refs::{Core, Mm, TaskCore, ThreadInfoX86, UserX86Regs, Vma};
use stasis_proto::criu::{InventoryEntry, PstreeEntry};

use crate::image_set::CORE_MAGIC;
use crate::images::{IMG_COMMON_MAGIC, INVENTORY_FILE, MM_MAGIC, PSTREE_MAGIC, push};

pub(crate) const ANON_SHARED: u32 = (1 << 8) | 1;

/// An image file: the magics, then each message.
pub(crate) fn image<M: Message>(magic: u32, messages: &[M]) -> Vec<u8> {
    let mut out = IMG_COMMON_MAGIC.to_ne_bytes().to_vec();
    out.extend(magic.to_ne_bytes());
    messages.iter().for_each(|m| push(&mut out, m));
    out
}

pub(crate) fn process(pid: u32, threads: &[u32]) -> PstreeEntry {
    PstreeEntry { pid, ppid: 0, pgid: pid, sid: pid, threads: threads.to_vec() }
}

/// `orig_ax` of a thread CRIU stopped in a system call (`clock_nanosleep`).
pub const IN_SYSCALL: u64 = 230;
/// `orig_ax` of a thread CRIU stopped outside of one.
pub const RUNNING: u64 = u64::MAX;

#[cfg(test)]
pub(crate) fn core(state: u32) -> Vec<u8> {
    thread_core(Some(state), None)
}

/// A thread's core image: with the task's state if it leads its process, and with registers
/// holding `orig_ax` if given.
pub(crate) fn thread_core(state: Option<u32>, orig_ax: Option<u64>) -> Vec<u8> {
    let thread_info = orig_ax.map(|orig_ax| ThreadInfoX86 { gpregs: UserX86Regs { orig_ax } });
    image(CORE_MAGIC, &[Core { thread_info, tc: state.map(|task_state| TaskCore { task_state }) }])
}

/// Rewrites the core image of the one process of a dump [`write_dump_images`] wrote, as
/// CRIU writes it for a process it stopped outside a system call.
pub fn catch_running(dir: &Path, pid: u32) {
    std::fs::write(dir.join(format!("core-{pid}.img")), thread_core(Some(1), Some(RUNNING))).unwrap();
}

pub(crate) fn mm(vmas: &[(u64, u64, u32)]) -> Vec<u8> {
    let vmas = vmas.iter().map(|&(start, shmid, status)| Vma {
        start,
        end: start + 0x1000,
        shmid,
        flags: 0x21,
        status,
    });
    image(MM_MAGIC, &[Mm { exe_file_id: None, vmas: vmas.collect() }])
}

/// The images CRIU writes beside the pages it sends for a tree of one live process `pid`,
/// with a shared anonymous mapping for each of `shared` (their shmids): what a fake dump
/// leaves in `dir`.
pub fn write_dump_images(dir: &Path, pid: u32, shared: &[u64]) {
    write_inventory(dir, "");
    std::fs::write(dir.join("pstree.img"), image(PSTREE_MAGIC, &[process(pid, &[pid])])).unwrap();
    std::fs::write(dir.join(format!("core-{pid}.img")), thread_core(Some(1), Some(IN_SYSCALL))).unwrap();
    let mut vmas = vec![(0x10000, 0, 1 << 9)];
    vmas.extend(
        shared.iter().enumerate().map(|(i, &shmid)| (0x7000_0000 + ((i as u64) << 20), shmid, ANON_SHARED)),
    );
    std::fs::write(dir.join(format!("mm-{pid}.img")), mm(&vmas)).unwrap();
}

/// Writes an inventory image recording CRIU run `run_id` into `dir`, as CRIU does.
pub fn write_inventory(dir: &Path, run_id: &str) -> Vec<u8> {
    let entry = InventoryEntry { dump_criu_run_id: Some(run_id.into()) };
    let mut data = 0x5831_1116u32.to_ne_bytes().to_vec();
    push(&mut data, &entry);
    std::fs::write(dir.join(INVENTORY_FILE), &data).unwrap();
    data
}
