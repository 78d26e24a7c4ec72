//! Which threads of a dumped tree were at work when CRIU stopped them.
//!
//! CRIU records each thread's registers as it found them. On x86-64, `orig_ax` holds the
//! number of the system call a thread was in (waiting in `epoll_wait`, `accept`, `futex`,
//! `clock_nanosleep`: what an idle program does) and -1 when the thread was stopped outside
//! of one, running its own code (or taking a fault). For a 32-bit task CRIU keeps the 32-bit
//! register, so only its low half is read. An idle reclaim reads this to tell a workload
//! caught serving a request from one that waits for the next.

use std::path::Path;

use stasis_proto::criu::PstreeEntry;
use stasis_proto::criu::refs::Core;

use crate::image_set::{CORE_MAGIC, ImageSetError, PSTREE_FILE, decode_all, decode_one, threads_of};
use crate::images::PSTREE_MAGIC;

/// `task_state` of a live process (not a zombie, not stopped).
const TASK_ALIVE: u32 = 1;

/// The threads (as the tree's pid namespace numbers them) of the live processes in dump
/// `dir` that CRIU stopped outside a system call. Threads whose registers the images do not
/// hold (another architecture) are not counted; stopped processes and zombies neither.
pub fn running_threads(dir: &Path) -> Result<Vec<u32>, ImageSetError> {
    let mut running = Vec::new();
    for process in decode_all::<PstreeEntry>(&read(dir, PSTREE_FILE)?, PSTREE_MAGIC, PSTREE_FILE)? {
        let leader = read_core(dir, process.pid)?;
        if leader.tc.is_none_or(|tc| tc.task_state != TASK_ALIVE) {
            continue;
        }
        for tid in threads_of(&process) {
            let core = if tid == process.pid { leader } else { read_core(dir, tid)? };
            // System call numbers are below 2^31 (x32's included); -1 is all ones.
            let orig_ax = core.thread_info.map(|t| t.gpregs.orig_ax as u32 as i32);
            if orig_ax.is_some_and(|nr| nr < 0) {
                running.push(tid);
            }
        }
    }
    Ok(running)
}

/// The core image of thread `tid` (one message).
fn read_core(dir: &Path, tid: u32) -> Result<Core, ImageSetError> {
    let name = format!("core-{tid}.img");
    decode_one(&read(dir, &name)?, CORE_MAGIC, &name)
}

/// Image `name` of dump `dir`.
fn read(dir: &Path, name: &str) -> Result<Vec<u8>, ImageSetError> {
    std::fs::read(dir.join(name)).map_err(|source| ImageSetError::Unreadable { image: name.into(), source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{self, IN_SYSCALL, RUNNING};

    /// A process: its pid, its threads (tid, `orig_ax`) and its task state.
    type Process<'a> = (u32, &'a [(u32, u64)], u32);

    /// Writes a dump of `processes`.
    fn dump(dir: &Path, processes: &[Process]) {
        let tree: Vec<_> = processes
            .iter()
            .map(|&(pid, threads, _)| testing::process(pid, &threads.iter().map(|t| t.0).collect::<Vec<_>>()))
            .collect();
        std::fs::write(dir.join("pstree.img"), testing::image(PSTREE_MAGIC, &tree)).unwrap();
        for &(pid, threads, state) in processes {
            for &(tid, orig_ax) in threads {
                let state = (tid == pid).then_some(state);
                std::fs::write(
                    dir.join(format!("core-{tid}.img")),
                    testing::thread_core(state, Some(orig_ax)),
                )
                .unwrap();
            }
        }
    }

    #[test]
    fn threads_stopped_outside_a_system_call_are_running() {
        let dir = tempfile::tempdir().unwrap();
        const STOPPED: u32 = 3;
        dump(
            dir.path(),
            &[
                (10, &[(10, IN_SYSCALL), (11, RUNNING), (12, IN_SYSCALL)], TASK_ALIVE),
                (20, &[(20, RUNNING)], TASK_ALIVE),
                (30, &[(30, RUNNING)], STOPPED),
                (40, &[(40, IN_SYSCALL)], TASK_ALIVE),
            ],
        );
        assert_eq!(running_threads(dir.path()).unwrap(), [11, 20]);
    }

    #[test]
    fn a_32_bit_thread_outside_a_system_call_is_running() {
        let dir = tempfile::tempdir().unwrap();
        // CRIU keeps a compat task's orig_eax: -1 in the low half only.
        // 256: epoll_wait, as ia32 numbers it.
        dump(dir.path(), &[(10, &[(10, 0xffff_ffff), (11, 256)], TASK_ALIVE)]);
        assert_eq!(running_threads(dir.path()).unwrap(), [10]);
    }

    #[test]
    fn a_zombie_and_registers_the_images_lack_count_as_waiting() {
        let dir = tempfile::tempdir().unwrap();
        dump(dir.path(), &[(10, &[(10, IN_SYSCALL)], TASK_ALIVE)]);
        std::fs::write(dir.path().join("core-10.img"), testing::thread_core(Some(TASK_ALIVE), None)).unwrap();
        assert!(running_threads(dir.path()).unwrap().is_empty());
        // A zombie's registers are not read, whatever they hold.
        std::fs::write(dir.path().join("core-10.img"), testing::thread_core(Some(2), Some(RUNNING))).unwrap();
        assert!(running_threads(dir.path()).unwrap().is_empty());
    }

    #[test]
    fn a_missing_or_damaged_core_image_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        dump(dir.path(), &[(10, &[(10, IN_SYSCALL), (11, IN_SYSCALL)], TASK_ALIVE)]);
        std::fs::write(dir.path().join("core-11.img"), b"not an image").unwrap();
        let err = running_threads(dir.path()).unwrap_err();
        assert!(matches!(&err, ImageSetError::Malformed { image, .. } if image == "core-11.img"), "{err}");
        std::fs::remove_file(dir.path().join("core-11.img")).unwrap();
        let err = running_threads(dir.path()).unwrap_err();
        assert!(matches!(&err, ImageSetError::Unreadable { image, .. } if image == "core-11.img"), "{err}");
    }
}
