//! Whether a reclaimed workload is in use once its dump has stopped it: the last look before
//! the tree is stopped for good.
//!
//! The watch on the workload's ports (`uses.rs`) sees what arrives after it began. A request
//! that came just before can still be waiting when the dump stops the tree:
//! - untaken: a connection in a listener's accept queue, or bytes unread on a connection. A
//!   program may also leave input there for good (a peer's close it has not read yet, a
//!   notice it reads with its next query), which no client waits on. So the reclaim looks at
//!   the tree's input twice before the dump, [`LEFT_UNREAD`] apart while the tree runs: what
//!   stayed untaken across both looks is the program's own business; anything beyond it at
//!   the stop came during the reclaim.
//! - taken and being served: the dump caught a thread outside a system call (an idle program
//!   waits in one), read from CRIU's images (`criu::running`).
//!
//! What this cannot see: a request taken before the watch began whose service waits in a
//! system call (on a database, say) when the tree stops; one a running program leaves unread
//! for longer than [`LEFT_UNREAD`]; and, where the watch cannot see a peer, a request that
//! came as the program took input it had left, as long as before (queues are compared by
//! length, not by what arrived).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tracing::{info, warn};

use crate::criu::running::running_threads;
use crate::engine::host::Host;
use crate::linux::net::WaitingInput;

/// How long input must stay untaken while the tree runs to count as left there by the
/// program, not as a request it has yet to come to.
pub const LEFT_UNREAD: Duration = Duration::from_millis(250);

/// What an idle reclaim knows of its workload's uses while the checkpoint runs.
#[derive(Debug, Default)]
pub struct ReclaimUses {
    /// Set once the watch sees a use while the tree runs.
    pub seen: Arc<AtomicBool>,
    /// Input the program left untaken, by socket inode: bytes, or for a listener connections.
    left: HashMap<u64, u32>,
}

/// Why a stopped tree is in use.
#[derive(Debug, PartialEq)]
pub enum InUse {
    /// The watch saw a use while the tree ran.
    Seen,
    /// Input came during the reclaim and waits untaken: each socket with what came beyond
    /// what the program had left there.
    Input(Vec<WaitingInput>),
    /// Threads the dump stopped outside a system call.
    AtWork(Vec<u32>),
}

impl ReclaimUses {
    /// Uses noted in `seen`, of a tree whose sockets held `first`, then `second` (looked at
    /// [`LEFT_UNREAD`] apart).
    pub fn new(seen: Arc<AtomicBool>, first: &[WaitingInput], second: &[WaitingInput]) -> ReclaimUses {
        let first: HashMap<u64, u32> = first.iter().map(|w| (w.inode, w.queued)).collect();
        let left =
            second.iter().filter_map(|w| Some((w.inode, w.queued.min(*first.get(&w.inode)?)))).collect();
        ReclaimUses { seen, left }
    }

    /// Whether tree `pids`, stopped by a dump whose images are in `images`, is in use (see the
    /// module's comment). A tree that is gone (killed while stopped) is not, whatever was
    /// seen: there is nothing to give back, and its next use wakes it from the checkpoint.
    pub fn at_stop(&self, host: &dyn Host, pids: &[i32], images: &Path) -> Option<InUse> {
        if pids.is_empty() {
            return None;
        }
        if self.seen.load(Ordering::SeqCst) {
            return Some(InUse::Seen);
        }
        let came: Vec<WaitingInput> = host
            .waiting_input(pids)
            .into_iter()
            .filter_map(|w| {
                let left = self.left.get(&w.inode).copied().unwrap_or(0);
                (w.queued > left).then(|| WaitingInput { queued: w.queued - left, ..w })
            })
            .collect();
        if !came.is_empty() {
            return Some(InUse::Input(came));
        }
        match running_threads(images) {
            Ok(running) if !running.is_empty() => Some(InUse::AtWork(running)),
            Ok(_) => None,
            Err(e) => {
                warn!(images = %images.display(), error = %crate::error_chain(&e), "cannot tell from the dump whether the workload was at work; taken as idle");
                None
            }
        }
    }
}

impl InUse {
    /// Logs why the reclaim of checkpoint `checkpoint` backs off.
    pub fn log(&self, checkpoint: &str) {
        match self {
            InUse::Seen => {
                info!(checkpoint, "the workload was used during its reclaim: the reclaim backs off")
            }
            InUse::Input(came) => {
                info!(checkpoint, input = ?came, "input came during the reclaim and waits untaken: the reclaim backs off")
            }
            InUse::AtWork(threads) => {
                info!(
                    checkpoint,
                    ?threads,
                    "the dump caught threads at work, outside a system call: the reclaim backs off"
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::host::fake::FakeHost;
    use crate::engine::idle::tests::input;
    use stasis_criu_images::testing::{catch_running, write_dump_images};

    /// Whether a reclaim of a tree whose sockets hold `first`, `second` and then `stop`, and
    /// whose dump caught it at work (`running`), finds it in use.
    fn in_use(looks: [Vec<WaitingInput>; 3], running: bool) -> Option<InUse> {
        let host = FakeHost::default();
        let [first, second, stop] = looks;
        let uses = ReclaimUses::new(Arc::default(), &first, &second);
        host.waiting_input.lock().unwrap().push(stop);
        let images = tempfile::tempdir().unwrap();
        write_dump_images(images.path(), 1, &[]);
        if running {
            catch_running(images.path(), 1);
        }
        uses.at_stop(&host, &[1], images.path())
    }

    #[test]
    fn input_that_came_during_the_reclaim_is_a_use_and_input_left_unread_is_not() {
        let bytes = |n| input(80, 7, n, false);
        // Unread at both looks and at the stop: left there (a peer's close reads as 1 byte).
        assert_eq!(in_use([vec![bytes(1)], vec![bytes(1)], vec![bytes(1)]], false), None);
        assert_eq!(in_use([vec![bytes(40)], vec![bytes(40)], vec![bytes(12)]], false), None, "partly read");
        // More than was left: what came is reported.
        assert_eq!(
            in_use([vec![bytes(40)], vec![bytes(45)], vec![bytes(52)]], false),
            Some(InUse::Input(vec![bytes(12)]))
        );
        // Unread at the first look, taken before the second: a request being served, not left.
        assert_eq!(
            in_use([vec![bytes(40)], vec![], vec![bytes(40)]], false),
            Some(InUse::Input(vec![bytes(40)]))
        );
        // New at the second look or at the stop.
        assert_eq!(
            in_use([vec![], vec![bytes(5)], vec![bytes(5)]], false),
            Some(InUse::Input(vec![bytes(5)]))
        );
        assert_eq!(in_use([vec![], vec![], vec![bytes(5)]], false), Some(InUse::Input(vec![bytes(5)])));
    }

    #[test]
    fn connections_waiting_to_be_accepted_count_as_bytes_do() {
        let waiting = |n| input(80, 9, n, true);
        assert_eq!(in_use([vec![waiting(2)], vec![waiting(2)], vec![waiting(2)]], false), None);
        assert_eq!(
            in_use([vec![waiting(2)], vec![waiting(2)], vec![waiting(3)]], false),
            Some(InUse::Input(vec![waiting(1)]))
        );
        assert_eq!(in_use([vec![], vec![], vec![waiting(1)]], false), Some(InUse::Input(vec![waiting(1)])));
    }

    #[test]
    fn a_thread_at_work_when_the_dump_stopped_it_is_a_use() {
        assert_eq!(in_use([vec![], vec![], vec![]], false), None, "threads in system calls wait");
        assert_eq!(in_use([vec![], vec![], vec![]], true), Some(InUse::AtWork(vec![1])));
    }

    #[test]
    fn a_dump_whose_threads_cannot_be_read_is_taken_as_idle() {
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(ReclaimUses::default().at_stop(&FakeHost::default(), &[1], empty.path()), None);
    }

    #[test]
    fn a_use_seen_while_the_tree_ran_counts_and_a_tree_gone_is_not_in_use() {
        let host = FakeHost::default();
        host.waiting_input.lock().unwrap().push(vec![input(80, 7, 5, false)]);
        let uses = ReclaimUses::default();
        uses.seen.store(true, Ordering::SeqCst);
        assert_eq!(uses.at_stop(&host, &[1], Path::new("/nonexistent")), Some(InUse::Seen));
        assert_eq!(uses.at_stop(&host, &[], Path::new("/nonexistent")), None, "killed while stopped");
    }
}
