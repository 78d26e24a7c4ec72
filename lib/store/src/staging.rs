//! Staging of the pages CRIU hands over during a dump.
//!
//! The page server must never make CRIU wait, or the tree stays frozen longer: received pages
//! go into memory segments up to a configured bound, and beyond it into a local spill file,
//! which is mapped (memmap2) once the dump is over. Hashing, compression and upload read the
//! staged pages afterwards, while the tree already runs again.

use std::fs::File;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{Advice, Mmap, MmapMut, MmapOptions};

use stasis_criu_images::pages::{PageRun, PageSink};
use stasis_linux::sys::{map_private_file, release_mapped_range};

/// Size of one memory segment; a run never spans two.
const SEGMENT: usize = 64 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loc {
    None,
    Memory { segment: usize, offset: usize },
    Spill { offset: u64 },
}

/// A received run and where its bytes are staged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedRun {
    pub run: PageRun,
    loc: Loc,
}

/// The daemon's bound on staged page bytes held in memory, shared by every dump under way:
/// what does not fit goes to the dump's spill file.
#[derive(Debug, Clone)]
pub struct StagingBudget {
    limit: u64,
    used: Arc<AtomicU64>,
}

impl StagingBudget {
    pub fn new(limit: u64) -> StagingBudget {
        StagingBudget { limit, used: Arc::new(AtomicU64::new(0)) }
    }

    /// Takes `len` bytes of the budget, if that many are left.
    fn take(&self, len: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(len).filter(|&after| after <= self.limit)
            })
            .is_ok()
    }

    /// Bytes held in memory by all dumps now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
}

/// Budget bytes a dump holds, given back when it is dropped.
#[derive(Debug)]
struct Held {
    budget: StagingBudget,
    bytes: u64,
}

impl Held {
    /// Gives `bytes` of the share back before the rest.
    fn give_back(&mut self, bytes: u64) {
        self.bytes -= bytes;
        self.budget.used.fetch_sub(bytes, Ordering::AcqRel);
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Collects a dump's pages (the [`PageSink`] of the page server).
#[derive(Debug)]
pub struct Staging {
    held: Held,
    /// Segments receiving pages, then those made ahead by [`Staging::reserve`] and not used
    /// yet; `current` is the one being filled.
    segments: Vec<Segment>,
    current: usize,
    /// Budget taken by [`Staging::reserve`] that no page has used yet.
    prepaid: u64,
    spill_path: PathBuf,
    spill: Option<File>,
    spilled: u64,
    runs: Vec<StagedRun>,
    /// The memory images CRIU opened, in order: some may have no run.
    opened: Vec<u64>,
}

impl Staging {
    /// Stages in memory what `budget` allows, the rest in a file at `spill_path`.
    pub fn new(budget: &StagingBudget, spill_path: &Path) -> Self {
        Self {
            held: Held { budget: budget.clone(), bytes: 0 },
            segments: Vec::new(),
            current: 0,
            prepaid: 0,
            spill_path: spill_path.to_path_buf(),
            spill: None,
            spilled: 0,
            runs: Vec::new(),
            opened: Vec::new(),
        }
    }

    /// Makes and faults in segments for about `bytes` of pages (as far as the budget has room
    /// now), before the dump: then the tree, once frozen, does not wait while every page
    /// received is faulted in and zeroed. Only an optimization: failures are ignored.
    pub fn reserve(&mut self, bytes: u64) {
        let room = self.held.budget.limit.saturating_sub(self.held.budget.used());
        let segments = bytes.div_ceil(SEGMENT as u64).min(room / SEGMENT as u64);
        if segments == 0 || !self.held.budget.take(segments * SEGMENT as u64) {
            return;
        }
        self.held.bytes += segments * SEGMENT as u64;
        self.prepaid += segments * SEGMENT as u64;
        for _ in 0..segments {
            match Segment::new(SEGMENT) {
                Ok(segment) => {
                    let _ = segment.map.advise(Advice::PopulateWrite);
                    self.segments.push(segment);
                }
                Err(_) => return,
            }
        }
    }

    /// Ends reception; the spill file, if any, is mapped for reading.
    pub fn finish(mut self) -> io::Result<Staged> {
        // Reserved segments left unused are given back now, with their share of the budget.
        self.held.give_back(std::mem::take(&mut self.prepaid));
        self.segments.truncate(self.segments.iter().rposition(|s| s.used > 0).map_or(0, |i| i + 1));
        let spill = match self.spill {
            Some(mut file) => {
                file.flush()?;
                Some(map_private_file(file)?)
            }
            None => None,
        };
        Ok(Staged {
            segments: self.segments,
            spill,
            spill_path: self.spill_path,
            runs: self.runs,
            opened: self.opened,
            _held: self.held,
        })
    }

    fn stage_in_memory(&mut self, len: usize, data: &mut dyn Read) -> io::Result<Loc> {
        let room = |s: &Segment| s.map.len() - s.used >= len;
        if !self.segments.get(self.current).is_some_and(room) {
            // The current segment is full (or unused: the first run): the next reserved one,
            // or a new one in its place.
            if self.segments.get(self.current).is_some_and(|s| s.used > 0) {
                self.current += 1;
            }
            if !self.segments.get(self.current).is_some_and(room) {
                self.segments.insert(self.current, Segment::new(SEGMENT.max(len))?);
            }
        }
        let segment = self.current;
        let seg = &mut self.segments[segment];
        let offset = seg.used;
        data.read_exact(&mut seg.map[offset..offset + len])?;
        seg.used += len;
        Ok(Loc::Memory { segment, offset })
    }

    fn stage_in_file(&mut self, len: u64, data: &mut dyn Read) -> io::Result<Loc> {
        if self.spill.is_none() {
            use std::os::unix::fs::OpenOptionsExt;
            let file =
                File::options().read(true).write(true).create_new(true).mode(0o600).open(&self.spill_path)?;
            self.spill = Some(file);
        }
        let file = self.spill.as_mut().expect("spill file just opened");
        let offset = self.spilled;
        let got = io::copy(&mut data.take(len), file)?;
        if got != len {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "page data cut short"));
        }
        self.spilled += len;
        Ok(Loc::Spill { offset })
    }
}

impl PageSink for Staging {
    fn open(&mut self, dst_id: u64) -> io::Result<()> {
        if !self.opened.contains(&dst_id) {
            self.opened.push(dst_id);
        }
        Ok(())
    }

    fn run(&mut self, run: PageRun, data: &mut dyn Read) -> io::Result<()> {
        let loc = if !run.has_data() {
            Loc::None
        } else if self.prepaid >= run.byte_len() {
            self.prepaid -= run.byte_len();
            self.stage_in_memory(run.byte_len() as usize, data)?
        } else if self.held.budget.take(run.byte_len()) {
            self.held.bytes += run.byte_len();
            self.stage_in_memory(run.byte_len() as usize, data)?
        } else {
            self.stage_in_file(run.byte_len(), data)?
        };
        self.runs.push(StagedRun { run, loc });
        Ok(())
    }
}

/// An anonymous mapping that received pages are copied into. It is advised to use huge pages:
/// a dump writes gigabytes into fresh memory while the tree is frozen, and 4 KiB page faults
/// would dominate that time.
#[derive(Debug)]
struct Segment {
    map: MmapMut,
    used: usize,
}

impl Segment {
    fn new(len: usize) -> io::Result<Self> {
        let map = MmapOptions::new().len(len).map_anon()?;
        // Only advice: without transparent huge pages the mapping still works.
        let _ = map.advise(Advice::HugePage);
        Ok(Self { map, used: 0 })
    }
}

/// The staged pages of one dump.
#[derive(Debug)]
pub struct Staged {
    segments: Vec<Segment>,
    spill: Option<Mmap>,
    spill_path: PathBuf,
    runs: Vec<StagedRun>,
    opened: Vec<u64>,
    /// Its share of the staging budget, given back with its memory.
    _held: Held,
}

impl Staged {
    /// The runs, in the order CRIU sent them.
    pub fn runs(&self) -> &[StagedRun] {
        &self.runs
    }

    /// The memory images CRIU opened (page-server destination ids), in order, whether or not
    /// any run of them came.
    pub fn opened(&self) -> &[u64] {
        &self.opened
    }

    /// The bytes of a run (empty for runs without data).
    pub fn bytes(&self, run: &StagedRun) -> &[u8] {
        let len = if run.run.has_data() { run.run.byte_len() as usize } else { 0 };
        match run.loc {
            Loc::None => &[],
            Loc::Memory { segment, offset } => &self.segments[segment].map[offset..offset + len],
            Loc::Spill { offset } => {
                let map = self.spill.as_ref().expect("spilled run has a spill map");
                &map[offset as usize..offset as usize + len]
            }
        }
    }

    /// Lets go of the memory a spilled run occupies once it has been processed (memory-staged
    /// runs stay: they are within the bound).
    pub fn release(&self, run: &StagedRun) {
        if let (Loc::Spill { offset }, Some(map)) = (run.loc, &self.spill) {
            release_mapped_range(map, offset as usize, run.run.byte_len() as usize);
        }
    }

    /// Bytes staged in total.
    pub fn len(&self) -> u64 {
        self.runs.iter().filter(|r| r.run.has_data()).map(|r| r.run.byte_len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if self.spill.take().is_some() {
            let _ = std::fs::remove_file(&self.spill_path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stasis_criu_images::pages::{PAGE_SIZE, PE_PRESENT};

    #[test]
    fn memory_then_spill_and_back() {
        let dir = tempfile::tempdir().unwrap();
        let spill = dir.path().join("spill");
        let budget = StagingBudget::new(2 * PAGE_SIZE);
        let mut staging = Staging::new(&budget, &spill);
        let run = |vaddr, nr_pages| PageRun { dst_id: 257, vaddr, nr_pages, flags: PE_PRESENT };
        let a = vec![1u8; 2 * PAGE_SIZE as usize];
        let b = vec![2u8; 3 * PAGE_SIZE as usize];
        staging.run(run(0x1000, 2), &mut &a[..]).unwrap();
        staging.run(run(0x9000, 3), &mut &b[..]).unwrap();
        staging.run(PageRun { flags: 0, ..run(0xf000, 1) }, &mut &[][..]).unwrap();
        assert!(staging.run(run(0x20000, 1), &mut &[0u8; 10][..]).is_err(), "short data is an error");
        let staged = staging.finish().unwrap();
        assert!(spill.exists());
        assert_eq!(staged.bytes(&staged.runs()[0]), &a[..]);
        assert_eq!(staged.bytes(&staged.runs()[1]), &b[..]);
        assert!(staged.bytes(&staged.runs()[2]).is_empty());
        assert_eq!(staged.len(), 5 * PAGE_SIZE);
        // Another dump meanwhile finds the budget taken: its pages spill.
        let mut other = Staging::new(&budget, &dir.path().join("spill2"));
        other.run(run(0x1000, 1), &mut &a[..PAGE_SIZE as usize]).unwrap();
        let other = other.finish().unwrap();
        assert!(dir.path().join("spill2").exists(), "its page went to its spill file");
        drop(other);
        assert_eq!(budget.used(), 2 * PAGE_SIZE, "the first dump still holds its share");
        drop(staged);
        assert_eq!(budget.used(), 0, "given back with the staged pages");
        assert!(!spill.exists(), "spill file removed with the staged pages");
    }

    #[test]
    fn reserved_segments_are_filled_in_order_and_the_unused_ones_given_back() {
        let dir = tempfile::tempdir().unwrap();
        let budget = StagingBudget::new(4 * SEGMENT as u64);
        let mut staging = Staging::new(&budget, &dir.path().join("spill"));
        staging.reserve(3 * SEGMENT as u64 - 1);
        assert_eq!(staging.segments.len(), 3);
        let page = PAGE_SIZE as usize;
        let run = |vaddr, nr_pages| PageRun { dst_id: 257, vaddr, nr_pages, flags: PE_PRESENT };
        let one: Vec<u8> = vec![1; page];
        let whole: Vec<u8> = (0..SEGMENT).map(|i| (i / page) as u8).collect();
        let more: Vec<u8> = (0..SEGMENT + page).map(|i| (i / page) as u8 ^ 0x55).collect();
        staging.run(run(0x1000, 1), &mut &one[..]).unwrap();
        staging.run(run(0x10_0000, (SEGMENT / page) as u64), &mut &whole[..]).unwrap();
        staging.run(run(0x1000_0000, (SEGMENT / page + 1) as u64), &mut &more[..]).unwrap();
        staging.run(run(0x2000_0000, 1), &mut &one[..]).unwrap();
        let staged = staging.finish().unwrap();
        assert_eq!(staged.segments.len(), 4, "three reserved, one larger made between them");
        let bytes: Vec<&[u8]> = staged.runs().iter().map(|r| staged.bytes(r)).collect();
        assert_eq!(bytes, [&one[..], &whole[..], &more[..], &one[..]]);
        assert!(!dir.path().join("spill").exists(), "all in memory");
        assert_eq!(budget.used(), 2 * SEGMENT as u64 + 3 * page as u64, "what the pages use, no more");
        drop(staged);
        assert_eq!(budget.used(), 0);
        // Reserving takes from the budget: another dump meanwhile finds less room.
        let mut first = Staging::new(&budget, &dir.path().join("spill1"));
        first.reserve(10 * SEGMENT as u64);
        assert_eq!(budget.used(), 4 * SEGMENT as u64, "no more than the bound");
        let mut second = Staging::new(&budget, &dir.path().join("spill2"));
        second.reserve(SEGMENT as u64);
        assert!(second.segments.is_empty(), "nothing left to reserve");
        drop(first.finish().unwrap());
        assert_eq!(budget.used(), 0, "unused reservations are given back");
    }
}
