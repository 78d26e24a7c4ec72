//! Which memory of a restored child CRIU's restore inherits from its parent, copy-on-write.
//!
//! CRIU restores a tree top-down: a process maps its private memory and fills it with its
//! pages before it forks its children, so each child starts with its parent's memory shared
//! copy-on-write. A child's mapping that matches one of its parent's (same start and end, both
//! private, neither hugetlb, the same grows-down and anonymous flags, the same file for a file
//! mapping; parent and child running the same executable) is taken over from the parent
//! instead of mapped anew, and each page of it the child's images hold is compared with the
//! parent's: an equal page is left shared, another one written (copied), and a parent's page
//! the child's images do not hold dropped. What memory is shared after a restore therefore
//! depends on which pages the parent's mapping holds when the child is forked.

use stasis_proto::criu::refs::{Mm, Vma};

/// CRIU's status bits of a mapping (`VMA_AREA_*`) this needs.
const VMA_AREA_REGULAR: u32 = 1 << 0;
const VMA_FILE_PRIVATE: u32 = 1 << 6;
const VMA_ANON_PRIVATE: u32 = 1 << 9;
const VMA_AREA_AIORING: u32 = 1 << 13;
const VMA_AREA_SHSTK: u32 = 1 << 15;
/// Not a mapping: pages guarded with `MADV_GUARD_INSTALL`, listed after the mappings.
const VMA_AREA_GUARD: u32 = 1 << 16;

const MAP_GROWSDOWN: u32 = 0x100;
const MAP_ANONYMOUS: u32 = 0x20;
const MAP_HUGETLB: u32 = 0x40000;

/// The end of the largest user address space (x86-64 with 5-level paging): CRIU counts no
/// mapping past the task size as private memory, and only the vsyscall page lies there.
const TASK_SIZE: u64 = (1 << 56) - 0x1000;

/// A process's memory layout as its mm image records it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Layout {
    exe_file_id: u32,
    vmas: Vec<Vma>,
}

impl From<Mm> for Layout {
    fn from(mm: Mm) -> Layout {
        let mut vmas = mm.vmas;
        vmas.retain(|v| v.status & VMA_AREA_GUARD == 0);
        vmas.sort_by_key(|v| v.start);
        Layout { exe_file_id: mm.exe_file_id.unwrap_or(0), vmas }
    }
}

impl Layout {
    /// A zombie's: no memory.
    pub fn is_empty(&self) -> bool {
        self.vmas.is_empty()
    }

    /// The address ranges `[start, end)` of this (child's) memory that CRIU's restore takes
    /// over from `parent`'s, in address order.
    pub fn inherited_from(&self, parent: &Layout) -> Vec<(u64, u64)> {
        if self.is_empty() || parent.is_empty() || self.exe_file_id != parent.exe_file_id {
            return Vec::new();
        }
        self.vmas
            .iter()
            .filter(|vma| {
                let at = parent.vmas.partition_point(|p| p.start < vma.start);
                parent.vmas.get(at).is_some_and(|p| p.start == vma.start && cow_pair(vma, p))
            })
            .map(|vma| (vma.start, vma.end))
            .collect()
    }
}

/// Whether CRIU's restore lets a child's mapping `vma` take over its parent's `pvma` (which
/// starts where it does).
fn cow_pair(vma: &Vma, pvma: &Vma) -> bool {
    let (flags, pflags) = (vma.flags, pvma.flags);
    vma.end == pvma.end
        && private(vma)
        && private(pvma)
        && (flags | pflags) & MAP_HUGETLB == 0
        && (flags ^ pflags) & (MAP_GROWSDOWN | MAP_ANONYMOUS) == 0
        && (flags & MAP_ANONYMOUS != 0 || vma.shmid == pvma.shmid)
}

/// Whether a mapping is private memory CRIU maps before forking the children.
fn private(vma: &Vma) -> bool {
    let status = vma.status;
    let regular = status & VMA_AREA_REGULAR != 0
        && status & (VMA_ANON_PRIVATE | VMA_FILE_PRIVATE) != 0
        && vma.end <= TASK_SIZE;
    regular || status & (VMA_AREA_SHSTK | VMA_AREA_AIORING) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANON: u32 = VMA_AREA_REGULAR | VMA_ANON_PRIVATE;
    const PRIVATE: u32 = 0x02;

    fn vma(start: u64, end: u64, flags: u32, status: u32, shmid: u64) -> Vma {
        Vma { start, end, shmid, flags, status }
    }

    fn layout(exe: u32, vmas: Vec<Vma>) -> Layout {
        Mm { exe_file_id: Some(exe), vmas }.into()
    }

    #[test]
    fn matching_private_mappings_are_inherited() {
        let anon = PRIVATE | MAP_ANONYMOUS;
        let parent = layout(
            3,
            vec![
                vma(0x1000, 0x5000, anon, ANON, 0),
                vma(0x10000, 0x20000, PRIVATE, VMA_AREA_REGULAR | VMA_FILE_PRIVATE, 7),
                vma(0x30000, 0x40000, anon, ANON, 0),
                vma(0x50000, 0x60000, anon | MAP_HUGETLB, ANON, 0),
                vma(0x70000, 0x80000, 0x01 | MAP_ANONYMOUS, VMA_AREA_REGULAR | (1 << 8), 0),
                vma(0x90000, 0xa0000, anon, ANON, 0),
            ],
        );
        let child = layout(
            3,
            vec![
                vma(0x1000, 0x5000, anon, ANON, 0),
                // Same file.
                vma(0x10000, 0x20000, PRIVATE, VMA_AREA_REGULAR | VMA_FILE_PRIVATE, 7),
                // Grown since the fork: another end.
                vma(0x30000, 0x48000, anon, ANON, 0),
                vma(0x50000, 0x60000, anon | MAP_HUGETLB, ANON, 0),
                // Shared, not private.
                vma(0x70000, 0x80000, 0x01 | MAP_ANONYMOUS, VMA_AREA_REGULAR | (1 << 8), 0),
                // Grows down in the child only.
                vma(0x90000, 0xa0000, anon | MAP_GROWSDOWN, ANON, 0),
                // Only the child has it; a guard is no mapping.
                vma(0xb0000, 0xc0000, anon, ANON, 0),
                vma(0x1000, 0x2000, 0, VMA_AREA_GUARD, 0),
            ],
        );
        assert_eq!(child.inherited_from(&parent), vec![(0x1000, 0x5000), (0x10000, 0x20000)]);
        let other_file =
            layout(3, vec![vma(0x10000, 0x20000, PRIVATE, VMA_AREA_REGULAR | VMA_FILE_PRIVATE, 8)]);
        assert!(other_file.inherited_from(&parent).is_empty(), "another file");
    }

    #[test]
    fn another_executable_or_a_zombie_inherits_nothing() {
        let anon = PRIVATE | MAP_ANONYMOUS;
        let parent = layout(3, vec![vma(0x1000, 0x5000, anon, ANON, 0)]);
        assert!(layout(4, vec![vma(0x1000, 0x5000, anon, ANON, 0)]).inherited_from(&parent).is_empty());
        assert!(layout(3, vec![]).inherited_from(&parent).is_empty());
        assert!(
            layout(3, vec![vma(0x1000, 0x5000, anon, ANON, 0)]).inherited_from(&layout(3, vec![])).is_empty()
        );
    }
}
