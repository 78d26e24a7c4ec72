//! Records stasisd keeps on disk across crashes (the workload registry, the records of held
//! trees): replaced whole or not at all, and on disk before the call returns.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// The name a record is written under before it replaces `path`.
pub fn staging_name(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Replaces `path` with `data`: written to a file beside it, flushed to disk, renamed over it,
/// and the directory flushed too. A crash at any moment leaves the previous content or the
/// new one, never a part of either (a partly written staging file beside it at most).
pub fn replace(path: &Path, data: &[u8]) -> io::Result<()> {
    let staging = staging_name(path);
    let mut file = File::create(&staging)?;
    file.write_all(data)?;
    file.sync_all()?;
    drop(file);
    fs::rename(&staging, path)?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replace_cut_short_at_any_byte_leaves_the_previous_record() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("record.json");
        replace(&path, b"{\"old\": true}").unwrap();
        let new = b"{\"new\": [1, 2, 3]}";
        // A crash while the staging file is written: it holds the first `cut` bytes.
        for cut in 0..=new.len() {
            fs::write(staging_name(&path), &new[..cut]).unwrap();
            assert_eq!(fs::read(&path).unwrap(), b"{\"old\": true}", "cut at {cut}");
        }
        replace(&path, new).unwrap();
        assert_eq!(fs::read(&path).unwrap(), new);
        assert!(!staging_name(&path).exists());
    }
}
