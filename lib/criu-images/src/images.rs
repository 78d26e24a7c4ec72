//! Writing CRIU image files that stasis rebuilds for restore: the pagemap of a task or of a
//! shared-memory segment (the page data goes into a plain `pages-<id>.img` beside it); and
//! reading the one thing stasisd needs from a dump's inventory, the id of the dumping run.
//!
//! An image file is `u32 IMG_COMMON_MAGIC, u32 PAGEMAP_MAGIC`, then protobuf messages each
//! preceded by its length as a native u32: one `PagemapHead`, then one `PagemapEntry` per run.

use std::io::{self, Write};
use std::path::Path;

use prost::Message;
use stasis_proto::criu::refs::Mm;
use stasis_proto::criu::{InventoryEntry, PagemapEntry, PagemapHead, PstreeEntry};

use super::cow::Layout;
use crate::pages::PageRun;

pub(super) const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
const PAGEMAP_MAGIC: u32 = 0x5608_4025;
pub(super) const PSTREE_MAGIC: u32 = 0x5027_3030;
pub(super) const MM_MAGIC: u32 = 0x5749_2820;
pub(super) const TYPE_TASK: u64 = 1;
pub(super) const TYPE_SHMEM: u64 = 2;

/// Name of CRIU's inventory image.
pub const INVENTORY_FILE: &str = "inventory.img";

/// The id of the CRIU run that dumped the images in `images_dir` (from `inventory.img`, which
/// carries a single magic and one message); `None` for CRIU that records none.
pub fn dump_run_id(images_dir: &Path) -> io::Result<Option<String>> {
    let data = std::fs::read(images_dir.join(INVENTORY_FILE))?;
    let invalid = invalid("inventory");
    let at = if word(&data, 0) == Some(IMG_COMMON_MAGIC) { 8 } else { 4 };
    let len = word(&data, at).ok_or_else(|| invalid("truncated".into()))? as usize;
    let body = data.get(at + 4..at + 4 + len).ok_or_else(|| invalid("truncated".into()))?;
    let entry = InventoryEntry::decode(body).map_err(|e| invalid(e.to_string()))?;
    Ok(entry.dump_criu_run_id.filter(|id| !id.is_empty()))
}

/// The pid whose memory a page-server destination id names, if it names a task's memory
/// (not a shared-memory segment's).
pub fn task_of(dst_id: u64) -> Option<u64> {
    (dst_id & 0xff == TYPE_TASK).then_some(dst_id >> 8)
}

/// The pagemap file name CRIU expects for a page-server destination id.
pub fn pagemap_file_name(dst_id: u64) -> Option<String> {
    let id = dst_id >> 8;
    match dst_id & 0xff {
        TYPE_TASK => Some(format!("pagemap-{id}.img")),
        TYPE_SHMEM => Some(format!("pagemap-shmem-{id}.img")),
        _ => None,
    }
}

/// The name of process `pid`'s pagemap.
pub(super) fn task_pagemap(pid: u32) -> String {
    pagemap_file_name((u64::from(pid) << 8) | TYPE_TASK).expect("a task's pagemap has a name")
}

/// The pages file holding the data of the pagemap with `pages_id`.
pub fn pages_file_name(pages_id: u32) -> String {
    format!("pages-{pages_id}.img")
}

/// Writes a pagemap image whose present pages are in `pages-<pages_id>.img`, in run order.
pub fn write_pagemap(path: &Path, pages_id: u32, runs: &[PageRun]) -> io::Result<()> {
    let mut out = Vec::with_capacity(16 + runs.len() * 24);
    out.extend_from_slice(&IMG_COMMON_MAGIC.to_ne_bytes());
    out.extend_from_slice(&PAGEMAP_MAGIC.to_ne_bytes());
    push(&mut out, &PagemapHead { pages_id });
    for run in runs {
        let compat = u32::try_from(run.nr_pages)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "page run too long for a pagemap"))?;
        let entry = PagemapEntry {
            vaddr: run.vaddr,
            compat_nr_pages: compat,
            in_parent: None,
            flags: Some(run.flags),
            nr_pages: Some(run.nr_pages),
        };
        push(&mut out, &entry);
    }
    std::fs::File::create(path)?.write_all(&out)
}

/// Name of the directory (or link) in an images directory where CRIU's restore looks for the
/// images of a parent checkpoint.
pub const RESTORE_PARENT_DIR: &str = "parent";

/// Writes, in `images_dir`, a parent checkpoint that holds no pages for the processes `pids`:
/// each gets a pagemap with no runs (and an empty pages file). No run of the restore's own
/// pagemaps refers to it, so CRIU reads nothing from it; what it changes is that CRIU's lazy
/// restore, for a process whose pages have a parent, turns transparent huge pages off in that
/// process while it puts memory in place (and back to the checkpointed setting before the
/// process runs). A served restore needs that always: CRIU puts some pages in place inside
/// mappings whose other pages are served through the userfaultfd (a thread's stack page, a
/// forked child's copy-on-write memory), and a huge page faulted in for one of those would
/// fill the rest of its 2 MiB with zeros, which are present, so never faulted for, and the
/// process would read zeros where its memory was.
pub fn write_empty_parent(images_dir: &Path, pids: impl IntoIterator<Item = u32>) -> io::Result<()> {
    const PAGES_ID: u32 = 1;
    let dir = images_dir.join(RESTORE_PARENT_DIR);
    std::fs::create_dir(&dir)?;
    std::fs::File::create(dir.join(pages_file_name(PAGES_ID)))?;
    for pid in pids {
        write_pagemap(&dir.join(task_pagemap(pid)), PAGES_ID, &[])?;
    }
    Ok(())
}

/// The page-server destination id a pagemap file name stands for (`pagemap-<pid>.img`,
/// `pagemap-shmem-<id>.img`); `None` for any other name.
pub fn pagemap_dst_id(file_name: &str) -> Option<u64> {
    let stem = file_name.strip_prefix("pagemap-")?.strip_suffix(".img")?;
    match stem.strip_prefix("shmem-") {
        Some(id) => Some(id.parse::<u64>().ok()? << 8 | TYPE_SHMEM),
        None => Some(stem.parse::<u64>().ok()? << 8 | TYPE_TASK),
    }
}

/// Reads a pagemap image CRIU wrote: the id of its pages file and its runs (as `dst_id`'s),
/// in order. Entries of CRIU versions that wrote no flags are present unless in a parent.
pub fn read_pagemap(data: &[u8], dst_id: u64) -> io::Result<(u32, Vec<PageRun>)> {
    use crate::pages::{PE_PARENT, PE_PRESENT};
    let invalid = invalid("pagemap");
    let mut bodies = entries(data, PAGEMAP_MAGIC, "pagemap")?.into_iter();
    let head = bodies.next().ok_or_else(|| invalid("no head".into()))?;
    let head = PagemapHead::decode(head).map_err(|e| invalid(e.to_string()))?;
    let mut runs = Vec::new();
    for body in bodies {
        let e = PagemapEntry::decode(body).map_err(|e| invalid(e.to_string()))?;
        let flags = e.flags.unwrap_or(if e.in_parent == Some(true) { PE_PARENT } else { PE_PRESENT });
        let nr_pages = e.nr_pages.unwrap_or(u64::from(e.compat_nr_pages));
        if !run_fits(e.vaddr, nr_pages) {
            return Err(invalid(format!(
                "a run of {nr_pages} pages at {:#x} is outside any address space",
                e.vaddr
            )));
        }
        runs.push(PageRun { dst_id, vaddr: e.vaddr, nr_pages, flags });
    }
    Ok((head.pages_id, runs))
}

/// The end of the largest user address space (5-level paging: 128 PiB).
const ADDRESS_SPACE_END: u64 = 1 << 57;

/// Whether a run of `nr_pages` pages at `vaddr` is one a process can have: page-aligned, not
/// empty, and inside an address space (its byte length cannot wrap).
fn run_fits(vaddr: u64, nr_pages: u64) -> bool {
    use crate::pages::PAGE_SIZE;
    let end = nr_pages.checked_mul(PAGE_SIZE).and_then(|len| vaddr.checked_add(len));
    vaddr.is_multiple_of(PAGE_SIZE) && nr_pages > 0 && end.is_some_and(|end| end <= ADDRESS_SPACE_END)
}

/// The processes of a dumped tree (`pstree.img`): each one's pid and its parent's, in
/// CRIU's order (the root first), as the tree's own pid namespace numbers them.
pub fn read_pstree(data: &[u8]) -> io::Result<Vec<(u32, u32)>> {
    let bodies = entries(data, PSTREE_MAGIC, "pstree")?;
    let decode = |body: &[u8]| PstreeEntry::decode(body).map(|e| (e.pid, e.ppid));
    bodies.into_iter().map(decode).collect::<Result<_, _>>().map_err(|e| invalid("pstree")(e.to_string()))
}

/// The name of process `pid`'s mm image.
pub fn mm_file_name(pid: u32) -> String {
    format!("mm-{pid}.img")
}

/// A process's memory layout, from its mm image (`mm-<pid>.img`, one message).
pub fn read_mm(data: &[u8]) -> io::Result<Layout> {
    let bodies = entries(data, MM_MAGIC, "mm")?;
    let [body] = bodies.as_slice() else { return Err(invalid("mm")("not one entry".into())) };
    Mm::decode(*body).map(Layout::from).map_err(|e| invalid("mm")(e.to_string()))
}

/// The bodies of the messages in an image with magic `magic` (after the common magic).
pub(super) fn entries<'a>(data: &'a [u8], magic: u32, what: &'static str) -> io::Result<Vec<&'a [u8]>> {
    let invalid = invalid(what);
    if word(data, 0) != Some(IMG_COMMON_MAGIC) || word(data, 4) != Some(magic) {
        return Err(invalid("wrong magic".into()));
    }
    let (mut at, mut bodies) = (8, Vec::new());
    while let Some(len) = word(data, at) {
        let body = data.get(at + 4..at + 4 + len as usize).ok_or_else(|| invalid("truncated".into()))?;
        bodies.push(body);
        at += 4 + len as usize;
    }
    if at != data.len() {
        return Err(invalid("truncated".into()));
    }
    Ok(bodies)
}

/// The native-endian word of an image at byte `at`, if the image is that long.
fn word(data: &[u8], at: usize) -> Option<u32> {
    data.get(at..at + 4).map(|b| u32::from_ne_bytes(b.try_into().unwrap_or_default()))
}

/// An error naming a malformed image of kind `what`.
fn invalid(what: &'static str) -> impl Fn(String) -> io::Error {
    move |why| io::Error::new(io::ErrorKind::InvalidData, format!("{what} image: {why}"))
}

pub(super) fn push(out: &mut Vec<u8>, message: &impl Message) {
    let body = message.encode_to_vec();
    out.extend_from_slice(&(body.len() as u32).to_ne_bytes());
    out.extend_from_slice(&body);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pages::PE_PRESENT;
    use crate::testing::write_inventory;

    #[test]
    fn an_empty_parent_has_a_pagemap_without_runs_for_each_process() {
        let dir = tempfile::tempdir().unwrap();
        write_empty_parent(dir.path(), [1, 42]).unwrap();
        let parent = dir.path().join(RESTORE_PARENT_DIR);
        for pid in [1u32, 42] {
            let data = std::fs::read(parent.join(format!("pagemap-{pid}.img"))).unwrap();
            let (pages_id, runs) = read_pagemap(&data, u64::from(pid) << 8 | TYPE_TASK).unwrap();
            assert!(runs.is_empty(), "{runs:?}");
            let pages = std::fs::metadata(parent.join(pages_file_name(pages_id))).unwrap();
            assert_eq!(pages.len(), 0);
        }
        assert_eq!(std::fs::read_dir(&parent).unwrap().count(), 3);
    }

    #[test]
    fn a_written_pagemap_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let dst_id = 42 << 8 | TYPE_TASK;
        let runs = [
            PageRun { dst_id, vaddr: 0x1000, nr_pages: 3, flags: PE_PRESENT },
            PageRun { dst_id, vaddr: 0x9000, nr_pages: 1, flags: 0 },
        ];
        let path = dir.path().join("pagemap-42.img");
        write_pagemap(&path, 7, &runs).unwrap();
        assert_eq!(pagemap_dst_id("pagemap-42.img"), Some(dst_id));
        assert_eq!(pagemap_dst_id("pagemap-shmem-9.img"), Some(9 << 8 | TYPE_SHMEM));
        assert_eq!(pagemap_dst_id("pages-1.img"), None);
        let data = std::fs::read(&path).unwrap();
        assert_eq!(read_pagemap(&data, dst_id).unwrap(), (7, runs.to_vec()));
        assert!(read_pagemap(&data[..data.len() - 3], dst_id).is_err());
        assert!(read_pagemap(b"not an image", dst_id).is_err());
    }

    #[test]
    fn a_run_no_address_space_holds_is_refused() {
        let dst_id = 42 << 8 | TYPE_TASK;
        // 2^52 pages: 2^64 bytes, a length that wraps to 0.
        for (vaddr, nr_pages) in [(0x1000, 1 << 52), (0x1001, 1), (0x1000, 0), (u64::MAX - 0xfff, 2)] {
            let mut data = IMG_COMMON_MAGIC.to_ne_bytes().to_vec();
            data.extend_from_slice(&PAGEMAP_MAGIC.to_ne_bytes());
            push(&mut data, &PagemapHead { pages_id: 7 });
            let entry = PagemapEntry {
                vaddr,
                compat_nr_pages: nr_pages as u32,
                in_parent: None,
                flags: Some(PE_PRESENT),
                nr_pages: Some(nr_pages),
            };
            push(&mut data, &entry);
            let err = read_pagemap(&data, dst_id).unwrap_err();
            assert!(err.to_string().contains("outside any address space"), "{vaddr:#x} {nr_pages}: {err}");
        }
    }

    #[test]
    fn run_id_from_an_inventory() {
        let dir = tempfile::tempdir().unwrap();
        let run_id = "6383c660-7823-49bd-b693-208f034c13bd";
        let data = write_inventory(dir.path(), run_id);
        assert_eq!(dump_run_id(dir.path()).unwrap().as_deref(), Some(run_id));
        std::fs::write(dir.path().join(INVENTORY_FILE), &data[..10]).unwrap();
        assert!(dump_run_id(dir.path()).is_err());
    }

    #[test]
    fn names_and_layout() {
        assert_eq!(pagemap_file_name((1234 << 8) | 1).as_deref(), Some("pagemap-1234.img"));
        assert_eq!(pagemap_file_name((77 << 8) | 2).as_deref(), Some("pagemap-shmem-77.img"));
        assert_eq!(pagemap_file_name(5), None);
        assert_eq!(task_of((1234 << 8) | 1), Some(1234));
        assert_eq!(task_of((77 << 8) | 2), None);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pagemap-1.img");
        let run = PageRun { dst_id: 257, vaddr: 0x1000, nr_pages: 3, flags: PE_PRESENT };
        write_pagemap(&path, 9, &[run]).unwrap();
        let data = std::fs::read(&path).unwrap();
        assert_eq!(&data[..8], &[0x19, 0x43, 0x56, 0x54, 0x25, 0x40, 0x08, 0x56]);
        let head_len = u32::from_ne_bytes(data[8..12].try_into().unwrap()) as usize;
        assert_eq!(PagemapHead::decode(&data[12..12 + head_len]).unwrap().pages_id, 9);
        let rest = &data[12 + head_len..];
        let len = u32::from_ne_bytes(rest[..4].try_into().unwrap()) as usize;
        let e = PagemapEntry::decode(&rest[4..4 + len]).unwrap();
        assert_eq!((e.vaddr, e.compat_nr_pages, e.nr_pages, e.flags), (0x1000, 3, Some(3), Some(PE_PRESENT)));
    }
}
