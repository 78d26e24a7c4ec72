//! Room for the packs a store's checkpoints fill, queue and upload: at most
//! [`PACKS_IN_MEMORY`] at once, all checkpoints together, a few of their buffers kept for the
//! next packs once their uploads are done.
//!
//! A fresh buffer of a pack's size is faulted in and zeroed page by page as the pack fills,
//! on the one thread that packs a dump's chunks in order, while CRIU may be waiting for it:
//! under emulation that was a sixth of an eviction's packing thread. A kept buffer spares every
//! pack after the first that work. Only [`KEPT_AT_MOST`] are kept, enough for one dump's
//! flow (a pack filling while the one before uploads), so that kept pages do not add to the
//! memory packs take when many dumps run at once; and a buffer no pack took for a while goes
//! back to the system, so an idle stasisd holds none.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Packs held in memory at once, being filled, queued or uploaded, by all checkpoints
/// together: with their buffers' size, what packing adds to stasisd's memory beyond staging.
pub const PACKS_IN_MEMORY: usize = 6;
/// How long a buffer no pack took is kept.
const KEPT: Duration = Duration::from_secs(10);
/// Buffers kept at most.
const KEPT_AT_MOST: usize = 2;

/// Buffers given back, each with when.
type Kept = Mutex<Vec<(Vec<u8>, Instant)>>;

/// The room for packs of one store.
#[derive(Clone)]
pub(super) struct PackSlots {
    permits: Arc<Semaphore>,
    kept: Arc<Kept>,
    keep_for: Duration,
}

/// One pack's place among the [`PACKS_IN_MEMORY`], freed when dropped.
pub struct PackSlot {
    _permit: OwnedSemaphorePermit,
    /// Where its buffer goes back to.
    slots: PackSlots,
}

impl std::fmt::Debug for PackSlots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let free = self.permits.available_permits();
        f.debug_struct("PackSlots").field("free", &free).field("kept", &lock(&self.kept).len()).finish()
    }
}

impl std::fmt::Debug for PackSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackSlot").finish_non_exhaustive()
    }
}

impl Default for PackSlots {
    fn default() -> Self {
        Self::keeping_for(KEPT)
    }
}

impl PackSlots {
    /// Room whose buffers go back to the system once no pack took them for `keep_for`.
    pub(super) fn keeping_for(keep_for: Duration) -> Self {
        PackSlots { permits: Arc::new(Semaphore::new(PACKS_IN_MEMORY)), kept: Arc::default(), keep_for }
    }

    /// A place for a pack, once one is free, and an empty buffer with room for `bytes`: a
    /// kept one where one is.
    pub(super) async fn take(&self, bytes: usize) -> (PackSlot, Vec<u8>) {
        let permit = self.permits.clone().acquire_owned().await.expect("the semaphore is never closed");
        let kept = {
            let mut kept = lock(&self.kept);
            let at = kept.iter().position(|(buffer, _)| buffer.capacity() >= bytes);
            at.map(|at| kept.swap_remove(at).0)
        };
        let slot = PackSlot { _permit: permit, slots: self.clone() };
        (slot, kept.unwrap_or_else(|| Vec::with_capacity(bytes)))
    }

    /// Buffers kept now.
    #[cfg(test)]
    fn kept(&self) -> usize {
        lock(&self.kept).len()
    }
}

impl PackSlot {
    /// Keeps a pack's `buffer` for the next pack, and lets go of those no pack took for the
    /// slots' time (now, and once more that time later, so that an idle stasisd holds none).
    fn keep(&self, mut buffer: Vec<u8>) {
        buffer.clear();
        let PackSlots { kept, keep_for, .. } = &self.slots;
        let mut unused = lock(kept);
        let_go_of_unused(&mut unused, *keep_for);
        if unused.len() < KEPT_AT_MOST {
            unused.push((buffer, Instant::now()));
        }
        drop(unused);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(let_go_later(Arc::downgrade(kept), *keep_for));
        }
    }
}

/// After `keep_for`, lets go of the buffers of `kept` no pack took since.
async fn let_go_later(kept: Weak<Kept>, keep_for: Duration) {
    tokio::time::sleep(keep_for).await;
    if let Some(kept) = kept.upgrade() {
        let_go_of_unused(&mut lock(&kept), keep_for);
    }
}

/// Lets go of the buffers of `kept` no pack took for `keep_for`.
fn let_go_of_unused(kept: &mut Vec<(Vec<u8>, Instant)>, keep_for: Duration) {
    let now = Instant::now();
    kept.retain(|(_, at)| now.duration_since(*at) < keep_for);
}

fn lock(kept: &Kept) -> std::sync::MutexGuard<'_, Vec<(Vec<u8>, Instant)>> {
    kept.lock().unwrap_or_else(|p| p.into_inner())
}

/// A finished pack's bytes while they are uploaded: once the backend has dropped its last
/// part, the buffer is kept for the next pack and the pack's place is freed.
pub(super) struct PackBytes {
    pub(super) data: Vec<u8>,
    pub(super) slot: Option<PackSlot>,
}

impl AsRef<[u8]> for PackBytes {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

impl Drop for PackBytes {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            slot.keep(std::mem::take(&mut self.data));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_uploaded_pack_s_buffer_fills_the_next_pack_and_idle_ones_go() {
        let slots = PackSlots::keeping_for(Duration::from_millis(200));
        let (slot, mut buffer) = slots.take(1 << 20).await;
        buffer.extend_from_slice(&[7u8; 4096]);
        let at = buffer.as_ptr();
        let bytes = bytes::Bytes::from_owner(PackBytes { data: buffer, slot: Some(slot) });
        let part = bytes.slice(..100);
        drop(bytes);
        assert_eq!(slots.kept(), 0, "a part is still with the backend");
        drop(part);
        assert_eq!(slots.kept(), 1);
        let (_slot, again) = slots.take(1 << 20).await;
        assert_eq!((again.as_ptr(), again.len()), (at, 0), "the same buffer, empty");
        assert_eq!(slots.kept(), 0);
        drop(PackBytes { data: again, slot: Some(_slot) });
        assert_eq!(slots.kept(), 1);
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(slots.kept(), 0, "a buffer no pack took goes back");
    }

    #[tokio::test]
    async fn never_more_packs_at_once_than_the_slots_and_only_a_few_buffers_kept() {
        let slots = PackSlots::default();
        let mut held = Vec::new();
        for _ in 0..PACKS_IN_MEMORY {
            held.push(slots.take(16).await);
        }
        let waiting = tokio::time::timeout(Duration::from_millis(50), slots.take(16)).await;
        assert!(waiting.is_err(), "a pack beyond the slots waits");
        let (slot, data) = held.pop().unwrap();
        drop(PackBytes { data, slot: Some(slot) });
        let (slot, buffer) = tokio::time::timeout(Duration::from_secs(5), slots.take(16)).await.unwrap();
        assert!(buffer.capacity() >= 16);
        held.push((slot, buffer));
        for (slot, data) in held {
            drop(PackBytes { data, slot: Some(slot) });
        }
        assert_eq!(slots.kept(), KEPT_AT_MOST, "the rest went back to the system");
    }
}
