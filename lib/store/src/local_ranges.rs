//! Ranges of a local store's packs, mapped rather than copied.
//!
//! A restore reads most of a checkpoint's packs. Through `read(2)` each byte is copied out of
//! the page cache into a fresh buffer before it is decompressed or checked: on a 2-core
//! machine that copy was 16 % of an 8 GiB eager restore's CPU time. Mapped, the page cache's
//! own pages are read in place, and a chunk stored raw reaches the restored process with one
//! copy (`UFFDIO_COPY`'s) instead of three.
//!
//! The pages are read in with `MADV_POPULATE_READ` (Linux 5.14) before any byte is touched,
//! so a disk that fails reports an error here rather than a signal later. Where that cannot be
//! done (an older kernel, a file shorter than the ranges, any other error) the caller reads
//! through the backend as before, and its error names what is wrong.

use std::ops::Range;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use memmap2::Advice;
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjPath;
use tracing::debug;

/// The directory of a `file://` store, to map its objects.
#[derive(Debug, Clone)]
pub(super) struct LocalObjects(pub(super) Arc<LocalFileSystem>);

impl LocalObjects {
    /// `ranges` of the object at `key`, each a slice of one mapping of the span they cover;
    /// `None` where they could not be mapped and read in.
    pub(super) async fn read(&self, key: &ObjPath, ranges: &[Range<u64>]) -> Option<Vec<Bytes>> {
        let path = self.0.path_to_filesystem(key).ok()?;
        let ranges = ranges.to_vec();
        let read = tokio::task::spawn_blocking(move || map_ranges(path, &ranges)).await.ok()?;
        read.map_err(|why| debug!(%key, why, "a pack could not be mapped: read instead")).ok()
    }
}

fn map_ranges(path: PathBuf, ranges: &[Range<u64>]) -> Result<Vec<Bytes>, String> {
    let (Some(start), Some(end)) = (ranges.iter().map(|r| r.start).min(), ranges.iter().map(|r| r.end).max())
    else {
        return Ok(Vec::new());
    };
    if ranges.iter().any(|r| r.start > r.end) || start == end {
        return Err("empty or reversed ranges".into());
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(&path)
        .map_err(|e| e.to_string())?;
    let size = file.metadata().map_err(|e| e.to_string())?.len();
    if end > size {
        return Err(format!("{size} bytes, ranges to {end}"));
    }
    let len = usize::try_from(end - start).map_err(|e| e.to_string())?;
    let map = stasis_linux::sys::map_store_object(&file, start, len).map_err(|e| e.to_string())?;
    for (from, to) in merged(ranges, start) {
        map.advise_range(Advice::PopulateRead, from, to - from).map_err(|e| format!("populate: {e}"))?;
    }
    let all = Bytes::from_owner(map);
    Ok(ranges.iter().map(|r| all.slice((r.start - start) as usize..(r.end - start) as usize)).collect())
}

/// `ranges`, relative to `base`, merged where they touch or overlap: what to read in.
fn merged(ranges: &[Range<u64>], base: u64) -> Vec<(usize, usize)> {
    let mut sorted: Vec<(usize, usize)> = ranges
        .iter()
        .filter(|r| r.start < r.end)
        .map(|r| ((r.start - base) as usize, (r.end - base) as usize))
        .collect();
    sorted.sort_unstable();
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(sorted.len());
    for (from, to) in sorted {
        match out.last_mut() {
            Some(last) if from <= last.1 => last.1 = last.1.max(to),
            _ => out.push((from, to)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touching_ranges_are_read_in_together() {
        assert_eq!(merged(&[20..30, 10..20, 40..50, 45..48], 10), [(0, 20), (30, 40)]);
        assert!(merged(&[5..5, 7..7], 0).is_empty());
    }

    #[tokio::test]
    async fn mapped_ranges_match_the_file_and_a_short_file_is_left_to_the_backend() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..3 * 4096 + 100).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(dir.path().join("pack"), &data).unwrap();
        let objects = LocalObjects(Arc::new(LocalFileSystem::new_with_prefix(dir.path()).unwrap()));
        let key = ObjPath::from("pack");
        let ranges = [5000..9000, 100..200, 12288..12388];
        let read = objects.read(&key, &ranges).await.expect("mapped");
        for (range, bytes) in ranges.iter().zip(&read) {
            assert_eq!(&bytes[..], &data[range.start as usize..range.end as usize]);
        }
        let (past_the_end, any) = (vec![0..4096, 4096..12389], vec![0..1, 1..2]);
        assert!(objects.read(&key, &past_the_end).await.is_none(), "past the end");
        assert!(objects.read(&ObjPath::from("missing"), &any).await.is_none());
        assert_eq!(objects.read(&key, &[]).await.map(|r| r.len()), Some(0));
    }
}
