//! Dirty-page tracking across a tree's checkpoints.
//!
//! Where the kernel tracks soft-dirty pages, every dump asks CRIU to track memory: once it has
//! read a process's pages it clears their dirty bits. The next dump of the same tree then gets
//! its previous checkpoint as parent, and CRIU sends the pages written since, and the others as
//! "in parent" runs that the store takes from that checkpoint (`store/parent.rs`). Every
//! checkpoint stays whole: nothing is restored from a chain.
//!
//! The chain of a tree is its last committed tracked checkpoint, kept in memory only. It is
//! trusted only while nothing else cleared the tree's bits since, so it breaks (the next dump
//! reads everything and starts a new one) when:
//! - a dump of the tree fails or is not committed (its bits may be cleared all the same);
//! - a dump of another workload covers one of its processes (that one cleared their bits);
//! - the tree is another one (its root's pid or start time differ: a restore, a pid reused);
//! - stasisd restarts, or the store no longer holds the checkpoint's chunks.
//!
//! Nothing outside stasisd may clear the tree's soft-dirty bits (another CRIU's pre-dump with
//! memory tracking, say): that would hide written pages from the next dump.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tracing::{info, warn};

use super::frozen_memory::FrozenMemory;
use crate::engine::Engine;
use crate::engine::inspect::TreeInfo;
use crate::store::{Parent, ParentMemory, StreamSink};

/// The directory in a dump's images directory holding its parent's inventory image: CRIU
/// reads the parent dump's time from it, to tell processes started since (a pid reused). It,
/// and the link `parent` CRIU makes to it, are not regular files: storing the images passes
/// over them.
pub(super) const PARENT_DIR: &str = "parent-dump";
/// CRIU's inventory image.
const INVENTORY: &str = "inventory.img";

/// How `stasis status` says whether dumps track memory: `support` is the start's answer (on, or
/// off and why), `huge_pages` the kernel's transparent-huge-page mode now. Under "always" the
/// kernel keeps a huge page's soft-dirty bit for all its 2 MiB, so a write anywhere in it
/// counts for the whole: a job with writes scattered over its memory gains little, and
/// "madvise" tracks it by 4 KiB pages.
pub(crate) fn tracking_report(support: &Result<(), String>, huge_pages: Option<&str>) -> String {
    match (support, huge_pages) {
        (Ok(()), Some("always")) => {
            "on (soft-dirty, by 2 MiB where huge pages back memory: transparent huge \
                                     pages are 'always', 'madvise' tracks 4 KiB pages): a later checkpoint \
                                     reads only the pages written since"
                .into()
        }
        (Ok(()), _) => "on (soft-dirty): a later checkpoint reads only the pages written since".into(),
        (Err(why), _) => format!("off ({why}): every checkpoint reads all memory"),
    }
}

/// The last tracked checkpoint of a tree, which its next dump builds on.
#[derive(Debug)]
struct Link {
    /// The tree's processes and their start times when it was dumped.
    started: HashMap<i32, u64>,
    root: i32,
    memory: Arc<ParentMemory>,
    /// The dump's inventory image.
    inventory: Vec<u8>,
}

/// The chains of this node's workloads.
#[derive(Debug, Default)]
pub(in crate::engine) struct Chains(Mutex<HashMap<String, Link>>);

impl Chains {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Link>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// How one dump tracks dirty pages.
#[derive(Default)]
pub(super) struct Tracking {
    /// Ask CRIU to track memory (its bits are cleared after the dump).
    pub on: bool,
    /// The tree's previous checkpoint, whose pages CRIU may send as unchanged.
    pub parent: Option<Arc<ParentMemory>>,
}

impl Tracking {
    /// The parent for the store's chunker.
    pub(super) fn store_parent(&self, engine: &Engine) -> Option<Parent> {
        let memory = self.parent.clone()?;
        Some(engine.deps.store.parent(memory, tokio::runtime::Handle::current()))
    }

    /// `sink`, reading from the stopped `tree` the unchanged pages that share a window with
    /// written ones, when the dump has a parent (without one CRIU sends every page).
    pub(super) fn reading_tree(&self, engine: &Engine, tree: &TreeInfo, sink: StreamSink) -> StreamSink {
        match &self.parent {
            Some(parent) => sink.reading_unchanged_from(
                Box::new(FrozenMemory::of(engine.deps.host.clone(), tree)),
                parent.clone(),
            ),
            None => sink,
        }
    }

    /// The parent's directory, relative to the images directory, for CRIU.
    pub(super) fn criu_parent(&self) -> Option<PathBuf> {
        self.parent.as_ref().map(|_| PARENT_DIR.into())
    }
}

impl Engine {
    /// How the dump of `workload`'s `tree` (root `root`) into `images` tracks memory; under the
    /// checkpoint's commit guard, so that a collection cannot take the parent's chunks before
    /// the dump that references them commits. The workload's chain is taken: it continues only
    /// once this dump commits ([`Self::continue_chain`]). Chains of other workloads holding
    /// one of the tree's processes break, since this dump clears their bits.
    pub(super) fn begin_tracking(
        &self,
        workload: &str,
        root: i32,
        tree: &TreeInfo,
        images: &Path,
    ) -> Tracking {
        if self.support.memory_tracking.is_err() {
            return Tracking::default();
        }
        Tracking { on: true, parent: self.take_parent(workload, root, tree, images) }
    }

    /// The previous checkpoint of `workload`'s `tree`, its inventory image put in `images`
    /// for CRIU, if its chain goes on; the chains [`Self::begin_tracking`] breaks are broken.
    fn take_parent(
        &self,
        workload: &str,
        root: i32,
        tree: &TreeInfo,
        images: &Path,
    ) -> Option<Arc<ParentMemory>> {
        let link = {
            let mut chains = self.shared.chains.lock();
            let link = chains.remove(workload);
            chains.retain(|other, link| {
                let shared = tree.pids.iter().any(|pid| link.started.contains_key(pid));
                if shared {
                    info!(
                        workload = other,
                        by = workload,
                        "memory tracking chain broken: a dump of another workload holds its processes"
                    );
                }
                !shared
            });
            link?
        };
        let same_tree = link.root == root && link.started.get(&root) == tree.started.get(&root);
        if !same_tree {
            info!(workload, "memory tracking chain broken: the tree is not the one checkpointed before");
            return None;
        }
        if !link.memory.held_by(&self.deps.store) {
            info!(
                workload,
                checkpoint = link.memory.checkpoint(),
                "memory tracking chain broken: the store no longer holds the previous checkpoint"
            );
            return None;
        }
        let dir = images.join(PARENT_DIR);
        if let Err(e) =
            std::fs::create_dir(&dir).and_then(|()| std::fs::write(dir.join(INVENTORY), &link.inventory))
        {
            warn!(workload, error = %e, "cannot give CRIU the previous checkpoint; this dump reads all memory");
            return None;
        }
        Some(link.memory)
    }

    /// Makes the committed checkpoint `id` of `workload`'s `tree`, whose memory is `memory` (made
    /// before the commit; `Err` if its images were malformed), and whose dump in `images`
    /// tracked memory, the parent of its next dump.
    pub(super) fn continue_chain(
        &self,
        workload: &str,
        root: i32,
        tree: &TreeInfo,
        images: &Path,
        id: &str,
        memory: Result<ParentMemory, String>,
    ) {
        let link = std::fs::read(images.join(INVENTORY))
            .map_err(|e| e.to_string())
            .and_then(|inventory| Ok((inventory, memory?)));
        match link {
            Ok((inventory, memory)) => {
                let link = Link { started: tree.started.clone(), root, memory: Arc::new(memory), inventory };
                self.shared.chains.lock().insert(workload.into(), link);
            }
            Err(e) => {
                warn!(workload, checkpoint = id, error = %e, "cannot keep the checkpoint as the next one's parent")
            }
        }
    }
}

#[cfg(test)]
#[path = "tracking_tests.rs"]
mod tests;
