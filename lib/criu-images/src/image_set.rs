//! Whether a dump's images are a whole set for CRIU's restore: every image the others refer
//! to is there. A checkpoint missing one is reported durable and then fails every restore
//! (CRIU's restore opens it, finds nothing, and gives up), so a dump is checked before its
//! checkpoint is committed, and `stasis check` checks stored checkpoints the same way.
//!
//! The references followed are those of the tree and its memory, which stasis itself turns
//! into images (pagemaps from the page server's runs):
//!
//! ```text
//! inventory.img, pstree.img                      every restore reads them
//! pstree.img  -> core-<tid>.img                  each thread of each process
//! core-<pid>.img, unless a zombie's -> mm-<pid>.img and pagemap-<pid>.img
//! mm-<pid>.img -> pagemap-shmem-<shmid>.img      each shared anonymous mapping (not SysV)
//! memfd.img   -> pagemap-shmem-<shmid>.img       each memfd with content (CRIU dumps shared
//!                                                anonymous memory as memfds where it can)
//! ```

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use prost::Message;
use stasis_proto::criu::PstreeEntry;
use stasis_proto::criu::refs::{Core, MemfdInode, Mm};

use super::images::{
    INVENTORY_FILE, MM_MAGIC, PSTREE_MAGIC, TYPE_SHMEM, entries, pagemap_file_name, task_pagemap,
};

pub(super) const CORE_MAGIC: u32 = 0x5505_3847;
pub(super) const MEMFD_INODE_MAGIC: u32 = 0x4845_3499;
pub(crate) const PSTREE_FILE: &str = "pstree.img";
const MEMFD_FILE: &str = "memfd.img";
/// The task state of a zombie in its core image.
const TASK_DEAD: u32 = 2;
/// CRIU's status bits of a mapping: shared anonymous memory, and SysV shared memory (whose
/// content comes with the IPC namespace's images instead).
const VMA_ANON_SHARED: u32 = 1 << 8;
const VMA_AREA_SYSVIPC: u32 = 1 << 10;

/// An image another one refers to that the set lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingImage {
    pub image: String,
    /// What needs it, in words.
    pub needed_for: String,
}

impl std::fmt::Display for MissingImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (for {})", self.image, self.needed_for)
    }
}

/// A dump's image set is not one CRIU can restore.
#[derive(Debug, thiserror::Error)]
pub enum ImageSetError {
    #[error(
        "images are missing: {}",
        missing.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    )]
    Incomplete { missing: Vec<MissingImage> },
    #[error("image {image} is malformed: {reason}")]
    Malformed { image: String, reason: String },
    #[error("image {image} could not be read")]
    Unreadable {
        image: String,
        #[source]
        source: std::io::Error,
    },
}

/// The names of a dump's images: its files, and the pagemaps of its memory images (by their
/// page-server destination ids), which stasis writes itself for a restore.
pub fn image_names<'a>(
    files: impl IntoIterator<Item = &'a str>,
    memory: impl IntoIterator<Item = u64>,
) -> BTreeSet<String> {
    let pagemaps = memory.into_iter().filter_map(pagemap_file_name);
    files.into_iter().map(str::to_owned).chain(pagemaps).collect()
}

/// Whether [`check`] reads image `name`: the caller hands over the content of each such image
/// of the set.
pub fn read_by_check(name: &str) -> bool {
    let numbered = |prefix: &str| {
        name.strip_prefix(prefix)
            .and_then(|rest| rest.strip_suffix(".img"))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    name == PSTREE_FILE || name == MEMFD_FILE || numbered("core-") || numbered("mm-")
}

/// Checks that the images `names` hold every image the others refer to. `contents` has the
/// content of each image of `names` that [`read_by_check`] names.
pub fn check(names: &BTreeSet<String>, contents: &HashMap<String, Vec<u8>>) -> Result<(), ImageSetError> {
    let mut refs = Refs { names, missing: Vec::new() };
    refs.need(INVENTORY_FILE.into(), || "every restore".into());
    match contents.get(PSTREE_FILE) {
        Some(pstree) => {
            for process in decode_all::<PstreeEntry>(pstree, PSTREE_MAGIC, PSTREE_FILE)? {
                refs.process(&process, contents)?;
            }
        }
        None => refs.need(PSTREE_FILE.into(), || "every restore".into()),
    }
    if let Some(memfds) = contents.get(MEMFD_FILE) {
        for inode in decode_all::<MemfdInode>(memfds, MEMFD_INODE_MAGIC, MEMFD_FILE)? {
            if inode.size > 0 {
                let image = shmem_pagemap(u64::from(inode.shmid));
                refs.need(image, || {
                    format!("the {} bytes of memfd {} in {MEMFD_FILE}", inode.size, inode.shmid)
                });
            }
        }
    }
    refs.finish()
}

/// [`check`] of the images in directory `dir` named `names` (with the pagemaps of the
/// dump's memory images, which are not in `dir`).
pub fn check_dir(dir: &Path, names: &BTreeSet<String>) -> Result<(), ImageSetError> {
    let mut contents = HashMap::new();
    for name in names.iter().filter(|n| read_by_check(n)) {
        let data = std::fs::read(dir.join(name))
            .map_err(|source| ImageSetError::Unreadable { image: name.clone(), source })?;
        contents.insert(name.clone(), data);
    }
    check(names, &contents)
}

/// The images needed so far and which of them are missing.
struct Refs<'a> {
    names: &'a BTreeSet<String>,
    missing: Vec<MissingImage>,
}

impl Refs<'_> {
    /// Image `image` is needed, for what `needed_for` says.
    fn need(&mut self, image: String, needed_for: impl FnOnce() -> String) {
        if !self.names.contains(&image) && !self.missing.iter().any(|m| m.image == image) {
            self.missing.push(MissingImage { image, needed_for: needed_for() });
        }
    }

    /// The images process `p` of pstree.img needs.
    fn process(&mut self, p: &PstreeEntry, contents: &HashMap<String, Vec<u8>>) -> Result<(), ImageSetError> {
        let pid = p.pid;
        let core_name = format!("core-{pid}.img");
        if let Some(core) = contents.get(&core_name) {
            let core: Core = decode_one(core, CORE_MAGIC, &core_name)?;
            if core.tc.is_some_and(|tc| tc.task_state == TASK_DEAD) {
                // A zombie is its core image alone. CRIU (4.2) never sets the thread id it
                // writes for a zombie in pstree.img (whatever was in its memory), and its
                // restore never reads it: neither does this check.
                self.need(core_name, || format!("process {pid}, a zombie, in {PSTREE_FILE}"));
                return Ok(());
            }
        }
        for tid in threads_of(p) {
            self.need(format!("core-{tid}.img"), || {
                format!("thread {tid} of process {pid} in {PSTREE_FILE}")
            });
        }
        let mm_name = format!("mm-{pid}.img");
        self.need(mm_name.clone(), || format!("the address space of process {pid}"));
        self.need(task_pagemap(pid), || format!("the memory of process {pid}"));
        let Some(mm) = contents.get(&mm_name) else { return Ok(()) };
        let mm: Mm = decode_one(mm, MM_MAGIC, &mm_name)?;
        let shared = |status: u32| status & VMA_ANON_SHARED != 0 && status & VMA_AREA_SYSVIPC == 0;
        for vma in mm.vmas.iter().filter(|v| shared(v.status)) {
            self.need(shmem_pagemap(vma.shmid), || {
                format!("the shared memory at {:#x}-{:#x} of process {pid} in {mm_name}", vma.start, vma.end)
            });
        }
        Ok(())
    }

    fn finish(self) -> Result<(), ImageSetError> {
        match self.missing.is_empty() {
            true => Ok(()),
            false => Err(ImageSetError::Incomplete { missing: self.missing }),
        }
    }
}

fn shmem_pagemap(shmid: u64) -> String {
    pagemap_file_name((shmid << 8) | TYPE_SHMEM).expect("a shared memory pagemap has a name")
}

/// The threads of process `p` of pstree.img (CRIU lists none for a process of one thread).
pub(crate) fn threads_of(p: &PstreeEntry) -> Vec<u32> {
    if p.threads.is_empty() { vec![p.pid] } else { p.threads.clone() }
}

/// The one message of image `name`, whose magic is `magic`.
pub(crate) fn decode_one<M: Message + Default>(
    data: &[u8],
    magic: u32,
    name: &str,
) -> Result<M, ImageSetError> {
    let mut all = decode_all::<M>(data, magic, name)?;
    match all.len() {
        1 => Ok(all.remove(0)),
        _ => Err(malformed(name, "not one entry".into())),
    }
}

/// Every message of image `name`, whose magic is `magic`.
pub(crate) fn decode_all<M: Message + Default>(
    data: &[u8],
    magic: u32,
    name: &str,
) -> Result<Vec<M>, ImageSetError> {
    let bodies = entries(data, magic, "image").map_err(|e| malformed(name, e.to_string()))?;
    bodies.into_iter().map(|b| M::decode(b).map_err(|e| malformed(name, e.to_string()))).collect()
}

fn malformed(image: &str, reason: String) -> ImageSetError {
    ImageSetError::Malformed { image: image.into(), reason }
}
