//! Copy-on-write sharing through a restore that leaves memory in the store (issue 24, item 2).
//!
//! CRIU's own restore keeps it: a parent's memory is in place before it forks its children,
//! which compare each of their pages with the parent's and keep the equal ones shared (see
//! [`stasis_criu_images::cow`]). Memory put in place through a userfaultfd (stasisd's fault server,
//! or CRIU's lazy-pages daemon) cannot be: the tree exists before its memory does, and a page
//! copied into one process is that process's alone. So the chunks a child may share with its
//! parent (in memory the child inherits, where the parent holds memory too: chunks that
//! overlap, however each was cut) stay in CRIU's images, the parent's and the child's alike, and CRIU's restore puts them in
//! place and compares them page by page, sharing every page the child did not change since
//! the fork, as it would after a dump to files; the rest is left to the store. A lazy restore
//! thus brings a forked tree's inherited memory in before the tree runs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use stasis_proto::stasis::store::v1::MemoryImage;
use tracing::debug;

use super::image_runs::{chunk_addresses, image_runs};
use stasis_criu_images::images::{mm_file_name, read_mm, read_pstree, task_of};

/// Chunks CRIU's restore must put in place itself for the tree to share them: by task, their
/// addresses.
#[derive(Debug, Default)]
pub(super) struct SharedChunks(HashSet<(u64, u64)>);

/// A task's chunks, by address: their lengths, and whether they are all zeros.
type Chunks = BTreeMap<u64, (u32, bool)>;

impl SharedChunks {
    /// The chunks of `memory` that processes of the tree (whose `pstree.img` and `mm-*.img`
    /// are in `dir`) share with their parents.
    pub(super) fn find(dir: &Path, memory: &[MemoryImage]) -> Result<SharedChunks, String> {
        let read = |name: &str| std::fs::read(dir.join(name)).map_err(|e| format!("{name}: {e}"));
        let tree = read_pstree(&read("pstree.img")?).map_err(|e| e.to_string())?;
        let pids: HashSet<u32> = tree.iter().map(|(pid, _)| *pid).collect();
        let pairs: Vec<(u32, u32)> = tree.into_iter().filter(|(_, ppid)| pids.contains(ppid)).collect();
        let mut layouts = HashMap::new();
        for pid in pairs.iter().flat_map(|(pid, ppid)| [*pid, *ppid]) {
            if let std::collections::hash_map::Entry::Vacant(slot) = layouts.entry(pid) {
                let name = mm_file_name(pid);
                slot.insert(read_mm(&read(&name)?).map_err(|e| format!("{name}: {e}"))?);
            }
        }
        let chunks = task_chunks(memory)?;
        let mut shared = SharedChunks::default();
        for (pid, ppid) in pairs {
            let (Some(child), Some(parent)) = (chunks.get(&pid.into()), chunks.get(&ppid.into())) else {
                continue;
            };
            let inherited = layouts[&pid].inherited_from(&layouts[&ppid]);
            shared.add(pid.into(), ppid.into(), child, parent, &inherited);
        }
        debug!(chunks = shared.0.len(), "chunks shared copy-on-write, restored by CRIU");
        Ok(shared)
    }

    /// Adds the chunks `child` (task `pid`) holds in `inherited` memory that overlap chunks of
    /// `parent` (task `ppid`) of their kind, equal or not (CRIU's restore shares the pages that
    /// are equal): the child's and the parent's. A zero chunk over a data chunk shares nothing
    /// that CRIU's comparison would find, and would only take data out of a lazy restore.
    fn add(&mut self, pid: u64, ppid: u64, child: &Chunks, parent: &Chunks, inherited: &[(u64, u64)]) {
        for &(start, end) in inherited {
            // A chunk that begins before the mapping may reach into it.
            let from = child.range(..start).next_back().map_or(start, |(addr, _)| *addr);
            for (&addr, &(len, zero)) in child.range(from..end) {
                let child_end = addr + u64::from(len);
                if child_end <= start {
                    continue;
                }
                // The parent's chunks that overlap this one: those starting before its end
                // and ending after its start.
                let first = parent.range(..addr).next_back().map_or(addr, |(a, _)| *a);
                let overlapping: Vec<u64> = parent
                    .range(first..child_end)
                    .filter(|(a, (l, z))| **a + u64::from(*l) > addr && *z == zero)
                    .map(|(a, _)| *a)
                    .collect();
                if !overlapping.is_empty() {
                    self.0.insert((pid, addr));
                    self.0.extend(overlapping.into_iter().map(|a| (ppid, a)));
                }
            }
        }
    }

    /// Whether the chunk of task `pid` at `addr` is one CRIU's restore must put in place.
    pub(super) fn contains(&self, pid: u64, addr: u64) -> bool {
        self.0.contains(&(pid, addr))
    }
}

/// Every task's chunks, all-zero ones included: a zero chunk is memory the process held
/// (pages of zeros), which its children share as they share any other. Put in place by CRIU
/// (from zeros in the image files, nothing fetched), the children keep sharing it; filled
/// through a userfaultfd, each process would get copies of its own. Like shared data, it is
/// in place before a lazily restored tree runs: CRIU compares each inherited page of each
/// child with its parent's, which for gigabytes of zeros shared by many children takes time.
fn task_chunks(memory: &[MemoryImage]) -> Result<HashMap<u64, Chunks>, String> {
    let mut out: HashMap<u64, Chunks> = HashMap::new();
    for image in memory {
        let Some(pid) = task_of(image.dst_id) else { continue };
        let task = out.entry(pid).or_default();
        for (run, chunks) in image_runs(image)? {
            for (addr, c) in chunk_addresses(&run, chunks) {
                task.insert(addr, (c.len, c.hash.is_empty()));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(list: &[(u64, u32)]) -> Chunks {
        list.iter().map(|&(addr, len)| (addr, (len, false))).collect()
    }

    #[test]
    fn chunks_overlapping_the_parents_in_inherited_memory_are_left_to_crius_page_comparison() {
        let parent = chunks(&[(0x10000, 0x10000), (0x20000, 0x10000), (0x30000, 0x8000)]);
        let child = chunks(&[
            (0x10000, 0x10000),
            // Written since the fork (some of its pages, or all: CRIU compares them).
            (0x20000, 0x10000),
            // Cut shorter (the parent's pages run on further).
            (0x30000, 0x4000),
            // Where the parent holds nothing.
            (0x50000, 0x10000),
        ]);
        let mut shared = SharedChunks::default();
        shared.add(2, 1, &child, &parent, &[(0x18000, 0x40000), (0x50000, 0x60000)]);
        let mut found: Vec<(u64, u64)> = shared.0.iter().copied().collect();
        found.sort();
        assert_eq!(
            found,
            vec![(1, 0x10000), (1, 0x20000), (1, 0x30000), (2, 0x10000), (2, 0x20000), (2, 0x30000)],
            "the chunk reaching into the mapping, the one written since the fork, the one cut shorter"
        );
        let mut none = SharedChunks::default();
        none.add(2, 1, &child, &parent, &[]);
        assert!(none.0.is_empty(), "nothing inherited, nothing shared");
    }

    #[test]
    fn zero_chunks_pair_with_zero_chunks_and_data_with_data() {
        // Parent: zeros at 0x10000, data at 0x20000, zeros at 0x30000, data at 0x40000.
        let kinds =
            |list: &[(u64, bool)]| -> Chunks { list.iter().map(|&(a, z)| (a, (0x10000, z))).collect() };
        let parent = kinds(&[(0x10000, true), (0x20000, false), (0x30000, true), (0x40000, false)]);
        // Child: zeros over zeros, data over data, data over zeros, zeros over data.
        let child = kinds(&[(0x10000, true), (0x20000, false), (0x30000, false), (0x40000, true)]);
        let mut shared = SharedChunks::default();
        shared.add(2, 1, &child, &parent, &[(0x10000, 0x50000)]);
        let mut found: Vec<(u64, u64)> = shared.0.iter().copied().collect();
        found.sort();
        assert_eq!(found, vec![(1, 0x10000), (1, 0x20000), (2, 0x10000), (2, 0x20000)]);
    }
}
