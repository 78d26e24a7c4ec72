//! Which files a process holds that its own user could not open.
//!
//! CRIU restores a process's files by opening their paths as root, and checks only their size
//! and mode: a path that now leads elsewhere (a file replaced by a link since the checkpoint)
//! gives the restored process whatever it leads to. For a process that is not root's, every
//! file it holds (descriptors, file mappings) is therefore asked about with the process's own
//! ids before it runs: one its user could not open with the access it holds it with came
//! from root, not from the process.

use std::collections::HashSet;
use std::fs;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};

use crate::fdinfo::FdInfo;
use crate::sys::{Ids, as_user, may_access};

/// A file's identity: device and inode.
pub type FileId = (u64, u64);

/// One file a process holds, and the access it holds it with.
struct Held {
    /// How the process holds it: `fd 3 (/etc/x)`, `mapping 7f..-7f.. (/usr/lib/y)`.
    what: String,
    /// The file, open as `O_PATH`.
    file: OwnedFd,
    /// `R_OK`, `W_OK` or both.
    mode: i32,
}

/// The files process `pid` holds that its user (its filesystem uid and gid, and its groups)
/// may not open with the access it holds them with, each as `fd N (PATH)` or `mapping
/// START-END (PATH)`; empty for a process of root's. Files in `exempt` (ones stasisd handed
/// over itself) are not asked about, nor are pipes, sockets and other files without a path.
pub fn files_its_user_may_not_open(pid: i32, exempt: &HashSet<FileId>) -> io::Result<Vec<String>> {
    let Some(ids) = ids_of(&fs::read_to_string(format!("/proc/{pid}/status"))?) else {
        return Err(io::Error::other(format!("process {pid}'s status names no ids")));
    };
    if ids.uid == 0 {
        return Ok(Vec::new());
    }
    let mut held = descriptors(pid, exempt)?;
    held.extend(mappings(pid, exempt)?);
    let answers = as_user(ids, move || {
        held.into_iter()
            .map(|h| may_access(h.file.as_fd(), h.mode).map(|ok| (!ok).then_some(h.what)))
            .collect::<io::Result<Vec<_>>>()
    })??;
    Ok(answers.into_iter().flatten().collect())
}

/// The filesystem uid, gid and groups of a `/proc/PID/status` text.
fn ids_of(status: &str) -> Option<Ids> {
    let field = |key: &str| status.lines().find_map(|l| l.strip_prefix(key)).map(str::split_whitespace);
    // Real, effective, saved and filesystem ids: the last is what opening a file checks.
    let uid = field("Uid:")?.nth(3)?.parse().ok()?;
    let gid = field("Gid:")?.nth(3)?.parse().ok()?;
    let groups = field("Groups:").map(|g| g.filter_map(|g| g.parse().ok()).collect()).unwrap_or_default();
    Some(Ids { uid, gid, groups })
}

/// Opens `link` (a `/proc` link to a file with a path) as `O_PATH`; `None` for a socket, a
/// file in `exempt`, or one gone meanwhile.
fn open_held(link: &str, exempt: &HashSet<FileId>) -> io::Result<Option<OwnedFd>> {
    let file = match fs::OpenOptions::new().read(true).custom_flags(libc::O_PATH).open(link) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let meta = file.metadata()?;
    let skip = meta.file_type().is_socket() || exempt.contains(&(meta.dev(), meta.ino()));
    Ok((!skip).then(|| file.into()))
}

/// Process `pid`'s descriptors of files with a path, with the access each was opened for.
fn descriptors(pid: i32, exempt: &HashSet<FileId>) -> io::Result<Vec<Held>> {
    let mut held = Vec::new();
    for (fd, target) in crate::proc::fd_targets(pid)? {
        // `pipe:[..]`, `socket:[..]`, `anon_inode:..`: nothing CRIU opens by path.
        if !target.is_absolute() {
            continue;
        }
        let Some(file) = open_held(&format!("/proc/{pid}/fd/{fd}"), exempt)? else { continue };
        let Some(flags) = FdInfo::read(pid, fd).ok().and_then(|i| i.flags) else { continue };
        let mode = match flags & libc::O_ACCMODE {
            _ if flags & libc::O_PATH != 0 => continue,
            libc::O_WRONLY => libc::W_OK,
            libc::O_RDWR => libc::R_OK | libc::W_OK,
            _ => libc::R_OK,
        };
        held.push(Held { what: format!("fd {fd} ({})", target.display()), file, mode });
    }
    Ok(held)
}

/// Process `pid`'s file mappings: each needs its file readable, and writable if it is shared
/// and writable.
fn mappings(pid: i32, exempt: &HashSet<FileId>) -> io::Result<Vec<Held>> {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let mut seen = HashSet::new();
    let mut held = Vec::new();
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else { continue };
        let Some(path) = fields.nth(3).filter(|p| p.starts_with('/')) else { continue };
        let mode = match perms.contains('w') && perms.ends_with('s') {
            true => libc::R_OK | libc::W_OK,
            false => libc::R_OK,
        };
        if !seen.insert((path.to_owned(), mode)) {
            continue;
        }
        let Some(file) = open_held(&format!("/proc/{pid}/map_files/{range}"), exempt)? else { continue };
        held.push(Held { what: format!("mapping {range} ({path})"), file, mode });
    }
    Ok(held)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;

    #[test]
    fn the_ids_are_the_filesystem_ones_and_the_groups() {
        let status = "Name:\tx\nUid:\t1000\t1001\t1002\t1003\nGid:\t5\t6\t7\t8\nGroups:\t20 27 \n";
        assert_eq!(ids_of(status), Some(Ids { uid: 1003, gid: 8, groups: vec![20, 27] }));
        assert_eq!(ids_of("Name:\tx\n"), None);
    }

    /// `nobody` runs `sleep` holding `file` open as descriptor 5 (opened by root, kept across
    /// the switch of user, as a supervisor may hand it over) and its own /dev/null.
    fn nobody_holding(file: &std::path::Path) -> std::process::Child {
        let script = format!(
            "exec 5<>'{}'; exec setpriv --reuid nobody --regid nogroup --clear-groups -- sh -c 'echo ready; exec sleep 30' 6</dev/null",
            file.display()
        );
        // Its stdin and stderr are /dev/null, not whatever this test runner has (a log file
        // of root's, say, which user nobody may not write to).
        let mut child = std::process::Command::new("sh")
            .args(["-c", &script])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.as_mut().unwrap()).read_line(&mut line).unwrap();
        child
    }

    #[test]
    fn a_file_only_root_may_open_is_named_unless_exempt_and_an_open_one_is_not() {
        if nix::unistd::geteuid().as_raw() != 0 {
            eprintln!("skipping: needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        fs::write(&secret, "root's").unwrap();
        fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        let mut child = nobody_holding(&secret);
        let pid = child.id() as i32;
        let found = files_its_user_may_not_open(pid, &HashSet::new());
        let meta = fs::metadata(&secret).unwrap();
        let exempt = files_its_user_may_not_open(pid, &HashSet::from([(meta.dev(), meta.ino())]));
        fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
        let opened = files_its_user_may_not_open(pid, &HashSet::new());
        child.kill().unwrap();
        child.wait().unwrap();
        let found = found.unwrap();
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].starts_with("fd 5 (") && found[0].contains("secret"), "{found:?}");
        assert_eq!(exempt.unwrap(), Vec::<String>::new(), "a file stasisd handed over is not asked about");
        assert_eq!(opened.unwrap(), Vec::<String>::new(), "a file anyone may open is fine");
        // Root's own processes are not asked about.
        assert!(files_its_user_may_not_open(std::process::id() as i32, &HashSet::new()).unwrap().is_empty());
    }
}
