//! An eager restore's chunks put in place by the threads that decode them (the store's
//! [`Placer`]), not handed to the fault server through the cache: the copy into the process
//! is made while the chunk's bytes are still in that CPU's caches, several copies run at
//! once, and no chunk waits for the server's thread. The server learns what was put in place
//! from the store ([`crate::store::ChunkReader::take_placed`]) and fills in the rest itself.
//!
//! A copy goes to a chunk's image address, which is where its memory is only until the
//! process's mappings first change (mremap, munmap, madvise, fork). The kernel refuses every
//! copy (EAGAIN) from the start of such a change until the server has read its event; the
//! server reads a direct task's events holding the write side of the lock whose read side
//! each copy holds, and takes a task off at the first such event (a fault changes nothing:
//! CRIU's restorer touches a page or two before the tree runs). From then on the server alone puts
//! that task's memory in place, following where it is. A copy refused for any reason leaves
//! its chunk to the server too.
//!
//! The userfaultfds held here are let go ([`Direct::close`]) before the server lets go of its
//! own: a userfaultfd left open would leave the tree's faults waiting for nobody.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, RwLock};

use crate::engine::host::{FaultEvent, FaultFd};
use crate::linux::uffd::Event;
use crate::store::Placer;

/// The tasks whose memory the decoding threads may put in place, by pid in the checkpoint.
#[derive(Default)]
pub(super) struct Direct {
    targets: RwLock<HashMap<u64, Arc<dyn FaultFd>>>,
}

impl Direct {
    /// The memory of task `pid` may be put in place through `uffd` from now on.
    pub fn add(&self, pid: u64, uffd: Arc<dyn FaultFd>) {
        self.write().insert(pid, uffd);
    }

    /// Reads the events of task `pid` into `out` through its `uffd`, with no copy into it under
    /// way; if any says its mappings changed (anything but a fault), or the read failed, its
    /// memory is no longer put in place here. Returns whether it still is.
    pub fn read_events(&self, pid: u64, uffd: &dyn FaultFd, out: &mut Vec<FaultEvent>) -> io::Result<bool> {
        let mut targets = self.write();
        let read = uffd.read_events(out);
        let changed = out.iter().any(|e| !matches!(e, Event::PageFault { .. }));
        if read.is_err() || changed {
            targets.remove(&pid);
        }
        read.map(|()| targets.contains_key(&pid))
    }

    /// No more copies: lets go of every userfaultfd.
    pub fn close(&self) {
        self.write().clear();
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<u64, Arc<dyn FaultFd>>> {
        self.targets.write().unwrap_or_else(|p| p.into_inner())
    }
}

impl Placer for Direct {
    fn place(&self, pid: u64, addr: u64, bytes: &[u8]) -> bool {
        let targets = self.targets.read().unwrap_or_else(|p| p.into_inner());
        targets.get(&pid).is_some_and(|uffd| uffd.copy(addr, bytes).is_ok())
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
    use std::sync::Mutex;

    use nix::errno::Errno;

    use super::*;
    use crate::linux::uffd::FillError;

    /// A userfaultfd that reports the events given and records the copies made through it.
    struct Recorded {
        fd: OwnedFd,
        events: Mutex<Vec<Event<()>>>,
        copies: Mutex<Vec<(u64, Vec<u8>)>>,
        fails: Option<Errno>,
    }

    impl Recorded {
        fn new(fails: Option<Errno>) -> Arc<Recorded> {
            let fd = std::fs::File::open("/dev/null").unwrap().into();
            Arc::new(Recorded { fd, events: Mutex::new(Vec::new()), copies: Mutex::new(Vec::new()), fails })
        }
    }

    impl AsFd for Recorded {
        fn as_fd(&self) -> BorrowedFd<'_> {
            self.fd.as_fd()
        }
    }

    impl FaultFd for Recorded {
        fn read_events(&self, out: &mut Vec<FaultEvent>) -> io::Result<()> {
            let events = std::mem::take(&mut *self.events.lock().unwrap());
            out.extend(events.into_iter().map(|e| e.map_child(|()| unreachable!("no forks here"))));
            Ok(())
        }

        fn register(&self, _start: u64, _len: u64) -> io::Result<()> {
            Ok(())
        }

        fn copy(&self, dst: u64, src: &[u8]) -> Result<(), FillError> {
            if let Some(errno) = self.fails {
                return Err(FillError { errno, done: 0 });
            }
            self.copies.lock().unwrap().push((dst, src.to_vec()));
            Ok(())
        }

        fn zero(&self, _dst: u64, _len: u64) -> Result<(), FillError> {
            unreachable!("the decoding threads copy chunks only")
        }

        fn wake(&self, _start: u64, _len: u64) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn chunks_go_into_the_tasks_added_and_a_refused_copy_is_left_to_the_server() {
        let direct = Direct::default();
        let (one, refusing) = (Recorded::new(None), Recorded::new(Some(Errno::EAGAIN)));
        assert!(!direct.place(7, 0x1000, &[1; 8]), "no task added yet");
        direct.add(7, one.clone());
        direct.add(8, refusing.clone());
        assert!(direct.place(7, 0x1000, &[1; 8]));
        assert!(!direct.place(8, 0x1000, &[2; 8]), "a copy the kernel refused");
        assert!(!direct.place(9, 0x1000, &[3; 8]), "a task never added");
        assert_eq!(*one.copies.lock().unwrap(), [(0x1000, vec![1; 8])]);
    }

    #[test]
    fn a_fault_leaves_a_task_direct_and_a_mapping_change_takes_it_off() {
        let direct = Direct::default();
        let uffd = Recorded::new(None);
        direct.add(7, uffd.clone());
        let mut out = Vec::new();
        uffd.events.lock().unwrap().push(Event::PageFault { address: 0x1000 });
        assert!(direct.read_events(7, uffd.as_ref(), &mut out).unwrap(), "a fault changes no mapping");
        assert!(matches!(out[..], [Event::PageFault { address: 0x1000 }]), "the fault is the server's");
        assert!(direct.place(7, 0x1000, &[1; 8]));
        out.clear();
        uffd.events.lock().unwrap().push(Event::Remap { from: 0x1000, to: 0x9000, len: 0x1000 });
        assert!(!direct.read_events(7, uffd.as_ref(), &mut out).unwrap());
        assert!(matches!(out[..], [Event::Remap { .. }]));
        assert!(!direct.place(7, 0x2000, &[2; 8]), "a copy to where the memory was");
        assert_eq!(uffd.copies.lock().unwrap().len(), 1);
    }

    #[test]
    fn closed_it_holds_no_userfaultfd_and_copies_nothing() {
        let direct = Direct::default();
        let uffd = Recorded::new(None);
        direct.add(7, uffd.clone());
        direct.close();
        assert_eq!(Arc::strong_count(&uffd), 1, "a userfaultfd still held");
        assert!(!direct.place(7, 0x1000, &[1; 8]));
    }
}
