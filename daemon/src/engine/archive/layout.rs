//! The layout of container checkpoint archives (what Podman's `container checkpoint
//! --export`, CRI-O and containerd write, and `checkpointctl` reads): a tar, plain or
//! compressed, holding CRIU's images under `checkpoint/` (a directory entry of its own) and,
//! at the top, `config.dump` and `spec.dump` (JSON), `stats-dump` (CRIU's statistics), and
//! whatever else the engine keeps (`rootfs-diff.tar`, `network.status`, ...).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Component, Path};

use serde::{Deserialize, Serialize};

/// CRIU's images.
pub const IMAGES_DIR: &str = "checkpoint";
pub const CONFIG_DUMP: &str = "config.dump";
pub const SPEC_DUMP: &str = "spec.dump";
/// CRIU's dump statistics: in the images directory as CRIU writes them, at the top of the
/// archive as the engines move them.
pub const STATS_DUMP: &str = "stats-dump";
/// The manifest of a checkpoint stasis exported, for a faithful import.
pub const STASIS_MANIFEST: &str = "stasis-manifest.pb";
/// The prefix of a file image that holds a file of the archive outside `checkpoint/`.
pub const KEPT_PREFIX: &str = "archive:";

/// How an archive is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    /// `zstd`, `gzip` (or `gz`) or `none`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "zstd" | "" => Some(Self::Zstd),
            "gzip" | "gz" => Some(Self::Gzip),
            "none" => Some(Self::None),
            _ => None,
        }
    }

    /// What the first bytes of a file say it is compressed with.
    fn sniff(head: &[u8]) -> Self {
        match head {
            [0x28, 0xb5, 0x2f, 0xfd, ..] => Self::Zstd,
            [0x1f, 0x8b, ..] => Self::Gzip,
            _ => Self::None,
        }
    }
}

/// Opens archive `path` for reading, decompressing as its first bytes say.
pub fn open_archive(path: &Path) -> io::Result<tar::Archive<Box<dyn Read>>> {
    let mut head = [0u8; 4];
    let got = File::open(path)?.read(&mut head)?;
    let file = BufReader::new(File::open(path)?);
    let reader: Box<dyn Read> = match Compression::sniff(&head[..got]) {
        Compression::Zstd => Box::new(zstd::Decoder::with_buffer(file)?),
        Compression::Gzip => Box::new(flate2::read::GzDecoder::new(file)),
        Compression::None => Box::new(file),
    };
    Ok(tar::Archive::new(reader))
}

/// A compressing writer of a new archive file at `path` (which must not exist yet), keeping
/// the names of the entries it wrote.
pub struct ArchiveWriter {
    tar: tar::Builder<Box<dyn Write>>,
    entries: Vec<String>,
}

impl ArchiveWriter {
    pub fn create(path: &Path, compression: Compression) -> io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = File::options().write(true).create_new(true).mode(0o600).open(path)?;
        let out = BufWriter::new(file);
        let writer: Box<dyn Write> = match compression {
            Compression::Zstd => Box::new(zstd::Encoder::new(out, 3)?.auto_finish()),
            Compression::Gzip => Box::new(flate2::write::GzEncoder::new(out, flate2::Compression::fast())),
            Compression::None => Box::new(out),
        };
        let mut tar = tar::Builder::new(writer);
        tar.mode(tar::HeaderMode::Deterministic);
        Ok(Self { tar, entries: Vec::new() })
    }

    pub fn dir(&mut self, path: &str) -> io::Result<()> {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Directory);
        header.set_mode(0o700);
        header.set_size(0);
        self.tar.append_data(&mut header, format!("{path}/"), io::empty())?;
        self.entries.push(path.into());
        Ok(())
    }

    pub fn file(&mut self, path: &str, data: &[u8]) -> io::Result<()> {
        self.append(path, data.len() as u64, data)
    }

    /// Copies file `from` into the archive as `path`.
    pub fn copy(&mut self, path: &str, from: &Path) -> io::Result<()> {
        let file = File::open(from)?;
        let len = file.metadata()?.len();
        self.append(path, len, file)
    }

    fn append(&mut self, path: &str, len: u64, data: impl io::Read) -> io::Result<()> {
        let mut header = tar::Header::new_gnu();
        header.set_mode(0o600);
        header.set_size(len);
        self.tar.append_data(&mut header, path, data)?;
        self.entries.push(path.into());
        Ok(())
    }

    /// Writes the end of the archive and flushes it to disk; returns its entries, in order.
    pub fn finish(self) -> io::Result<Vec<String>> {
        let mut out = self.tar.into_inner()?;
        out.flush()?;
        Ok(self.entries)
    }
}

/// The path of an archive entry without a leading `./`, if it is a safe relative path: no
/// `..`, not absolute, not empty.
pub fn safe_entry_path(path: &Path) -> Option<String> {
    let mut parts = Vec::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => parts.push(part.to_str()?),
            Component::CurDir => {}
            _ => return None,
        }
    }
    (!parts.is_empty()).then(|| parts.join("/"))
}

/// The file image name that keeps archive path `path` (outside `checkpoint/`), and back.
pub fn kept_name(path: &str) -> Option<String> {
    (!path.contains(':')).then(|| format!("{KEPT_PREFIX}{}", path.replace('/', ":")))
}

pub fn kept_path(name: &str) -> Option<String> {
    Some(name.strip_prefix(KEPT_PREFIX)?.replace(':', "/"))
}

/// What `config.dump` says (the fields the engines share and `checkpointctl` reads).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ConfigDump {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    #[serde(default, rename = "rootfsImageName", skip_serializing_if = "String::is_empty")]
    pub rootfs_image_name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub runtime: String,
    #[serde(default, rename = "createdTime", skip_serializing_if = "Option::is_none")]
    pub created_time: Option<String>,
    #[serde(default, rename = "checkpointedTime", skip_serializing_if = "Option::is_none")]
    pub checkpointed_time: Option<String>,
}

/// What `spec.dump` (an OCI runtime spec) says that stasis uses.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SpecDump {
    #[serde(default, rename = "ociVersion")]
    pub oci_version: String,
    #[serde(default)]
    pub process: SpecProcess,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SpecProcess {
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub cwd: String,
}

/// Who wrote an archive, from its spec's annotations (as `checkpointctl` tells them apart).
pub fn engine_of(spec: &SpecDump, has_stasis_manifest: bool) -> &'static str {
    match spec.annotations.get("io.container.manager").map(String::as_str) {
        _ if has_stasis_manifest => "stasis",
        Some("libpod") => "podman",
        Some("cri-o") => "cri-o",
        _ => "containerd",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_paths_outside_the_archive_are_refused() {
        assert_eq!(
            safe_entry_path(Path::new("./checkpoint/core-1.img")).as_deref(),
            Some("checkpoint/core-1.img")
        );
        assert_eq!(safe_entry_path(Path::new("config.dump")).as_deref(), Some("config.dump"));
        for bad in ["../etc/passwd", "/etc/passwd", "checkpoint/../../x", ".", ""] {
            assert_eq!(safe_entry_path(Path::new(bad)), None, "{bad}");
        }
    }

    #[test]
    fn kept_names_map_back_to_their_paths() {
        assert_eq!(kept_name("volumes/data.tar").as_deref(), Some("archive:volumes:data.tar"));
        assert_eq!(kept_path("archive:volumes:data.tar").as_deref(), Some("volumes/data.tar"));
        assert_eq!(kept_name("odd:name"), None);
        assert_eq!(kept_path("core-1.img"), None);
    }

    #[test]
    fn an_archive_reads_back_whatever_its_compression() {
        let dir = tempfile::tempdir().unwrap();
        for (i, compression) in
            [Compression::None, Compression::Gzip, Compression::Zstd].into_iter().enumerate()
        {
            let path = dir.path().join(format!("a{i}.tar"));
            let mut w = ArchiveWriter::create(&path, compression).unwrap();
            w.dir(IMAGES_DIR).unwrap();
            w.file("checkpoint/x.img", b"image").unwrap();
            w.file(CONFIG_DUMP, b"{}").unwrap();
            w.finish().unwrap();
            assert!(
                ArchiveWriter::create(&path, compression).is_err(),
                "an existing file is not overwritten"
            );
            let mut archive = open_archive(&path).unwrap();
            let mut seen = Vec::new();
            for entry in archive.entries().unwrap() {
                let mut entry = entry.unwrap();
                let mut data = Vec::new();
                entry.read_to_end(&mut data).unwrap();
                seen.push((entry.path().unwrap().display().to_string(), data));
            }
            let names: Vec<&str> = seen.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, ["checkpoint/", "checkpoint/x.img", "config.dump"], "{compression:?}");
            assert_eq!(seen[1].1, b"image");
        }
    }
}
