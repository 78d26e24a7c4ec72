//! A memory image's runs with the chunks that hold their pages, and the parts of a run that
//! go one way or the other when a restore splits memory between CRIU's images and the store.

use stasis_proto::stasis::store::v1::{ChunkRef, MemoryImage};

use stasis_criu_images::pages::{PAGE_SIZE, PageRun};

/// The runs of `image` in order, each with the chunks holding its pages (none for a run
/// without data); `Err` says why the image is malformed.
pub(super) fn image_runs(image: &MemoryImage) -> Result<Vec<(PageRun, &[ChunkRef])>, String> {
    let mut chunks = image.chunks.as_slice();
    let mut out = Vec::with_capacity(image.runs.len());
    for r in &image.runs {
        let end = r.nr_pages.checked_mul(PAGE_SIZE).and_then(|len| r.vaddr.checked_add(len));
        if r.vaddr % PAGE_SIZE != 0 || end.is_none() {
            return Err(format!("a run of {} pages at {:#x} is impossible", r.nr_pages, r.vaddr));
        }
        let run = PageRun { dst_id: image.dst_id, vaddr: r.vaddr, nr_pages: r.nr_pages, flags: r.flags };
        let mine = match run.has_data() {
            true => {
                let n = chunks_covering(chunks, run.byte_len())
                    .ok_or_else(|| format!("chunks do not cut at {:#x}", run.vaddr))?;
                let (mine, rest) = chunks.split_at(n);
                chunks = rest;
                mine
            }
            false => &[],
        };
        out.push((run, mine));
    }
    if !chunks.is_empty() {
        return Err("chunks hold more bytes than its pages".into());
    }
    Ok(out)
}

/// The chunks of `run` (starting at its address) with their addresses.
pub(super) fn chunk_addresses<'a>(
    run: &PageRun,
    chunks: &'a [ChunkRef],
) -> impl Iterator<Item = (u64, &'a ChunkRef)> + 'a {
    chunks.iter().scan(run.vaddr, |addr, c| {
        let at = *addr;
        *addr += u64::from(c.len);
        Some((at, c))
    })
}

/// `run` (with its `chunks`) cut where `pick` (of a chunk's address) changes: the parts in
/// order, each with its chunks and what `pick` said of them.
pub(super) fn split_run<'a>(
    run: &PageRun,
    chunks: &'a [ChunkRef],
    pick: impl Fn(u64) -> bool,
) -> Vec<(PageRun, &'a [ChunkRef], bool)> {
    let mut parts: Vec<(PageRun, &'a [ChunkRef], bool)> = Vec::new();
    let mut first = 0;
    for (i, (addr, c)) in chunk_addresses(run, chunks).enumerate() {
        let picked = pick(addr);
        match parts.last_mut() {
            Some((part, mine, p)) if *p == picked => {
                part.nr_pages += u64::from(c.len) / PAGE_SIZE;
                *mine = &chunks[first..=i];
            }
            _ => {
                first = i;
                let part = PageRun { vaddr: addr, nr_pages: u64::from(c.len) / PAGE_SIZE, ..*run };
                parts.push((part, &chunks[i..=i], picked));
            }
        }
    }
    parts
}

/// How many of the first `chunks` hold exactly `len` bytes; `None` if they do not cut there.
fn chunks_covering(chunks: &[ChunkRef], len: u64) -> Option<usize> {
    let mut sum = 0u64;
    for (i, c) in chunks.iter().enumerate() {
        if sum == len {
            return Some(i);
        }
        sum += u64::from(c.len);
    }
    (sum == len).then_some(chunks.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use stasis_criu_images::pages::{PE_LAZY, PE_PRESENT};

    fn chunk(len: u32, hash: u8) -> ChunkRef {
        ChunkRef { hash: vec![hash; 32], len, ..Default::default() }
    }

    #[test]
    fn a_run_splits_where_the_pick_changes() {
        let run =
            PageRun { dst_id: 0x701, vaddr: 0x1f000, nr_pages: 1 + 16 + 16 + 2, flags: PE_PRESENT | PE_LAZY };
        let chunks = [chunk(0x1000, 1), chunk(0x10000, 2), chunk(0x10000, 3), chunk(0x2000, 4)];
        let parts = split_run(&run, &chunks, |addr| addr == 0x20000 || addr == 0x30000);
        let seen: Vec<(u64, u64, usize, bool)> =
            parts.iter().map(|(r, c, p)| (r.vaddr, r.nr_pages, c.len(), *p)).collect();
        assert_eq!(seen, vec![(0x1f000, 1, 1, false), (0x20000, 32, 2, true), (0x40000, 2, 1, false)]);
        assert!(parts.iter().all(|(r, _, _)| r.flags == run.flags && r.dst_id == run.dst_id));
        assert_eq!(parts[1].1[1].hash, vec![3; 32]);
        assert_eq!(split_run(&run, &chunks, |_| true).len(), 1, "one part when nothing changes");
    }

    #[test]
    fn runs_take_the_chunks_covering_them() {
        let image = MemoryImage {
            dst_id: 0x701,
            runs: vec![
                stasis_proto::stasis::store::v1::PageRun { vaddr: 0x10000, nr_pages: 17, flags: PE_PRESENT },
                stasis_proto::stasis::store::v1::PageRun { vaddr: 0x40000, nr_pages: 4, flags: 0 },
            ],
            chunks: vec![chunk(0x10000, 1), chunk(0x1000, 2)],
        };
        let runs = image_runs(&image).unwrap();
        assert_eq!(runs.iter().map(|(_, c)| c.len()).collect::<Vec<_>>(), vec![2, 0]);
        let addrs: Vec<u64> = chunk_addresses(&runs[0].0, runs[0].1).map(|(a, _)| a).collect();
        assert_eq!(addrs, vec![0x10000, 0x20000]);
        let short = MemoryImage { chunks: vec![chunk(0x10000, 1)], ..image.clone() };
        assert!(image_runs(&short).is_err(), "chunks that do not cover the run");
        let long =
            MemoryImage { chunks: vec![chunk(0x10000, 1), chunk(0x1000, 2), chunk(0x1000, 3)], ..image };
        assert!(image_runs(&long).is_err(), "chunks left over");
    }
}
