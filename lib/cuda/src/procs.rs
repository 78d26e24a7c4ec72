//! Finding the processes that have CUDA loaded, from /proc alone (no driver needed).

use std::fs;
use std::io::{self, BufRead, BufReader};
use std::path::Path;

use tracing::debug;

/// Which of `pids` have CUDA loaded, in the order given: a process qualifies when
/// `/proc/PID/maps` maps `libcuda.so*` or a `/dev/nvidia*` device, or when `/proc/PID/fd` holds
/// a `/dev/nvidia*` descriptor. A pid that cannot be read (gone, or not permitted) does not.
///
/// This is a cheap pre-filter: the driver's `cuCheckpointProcessGetState` is the authority
/// (a process may load libcuda without ever creating a context). After
/// `cuCheckpointProcessCheckpoint` the `/dev/nvidia*` descriptors are closed but libcuda stays
/// mapped, so a checkpointed process still qualifies.
pub fn cuda_candidates(pids: &[i32]) -> Vec<i32> {
    matching(pids, maps_line_is_cuda)
}

/// Which of `pids` hold an NVIDIA device file, open or mapped (libcuda alone does not count):
/// a child forked from a CUDA process holds them without a CUDA context of its own.
pub fn nvidia_device_holders(pids: &[i32]) -> Vec<i32> {
    matching(pids, maps_line_is_device)
}

/// Which of `pids` map a file `maps_line` accepts or hold an NVIDIA device descriptor.
fn matching(pids: &[i32], maps_line: fn(&str) -> bool) -> Vec<i32> {
    let proc = Path::new("/proc");
    pids.iter()
        .copied()
        .filter(|&pid| match scan(proc, pid, maps_line) {
            Ok(yes) => yes,
            Err(err) => {
                debug!(pid, %err, "cannot inspect process for NVIDIA files");
                false
            }
        })
        .collect()
}

fn scan(proc: &Path, pid: i32, maps_line: fn(&str) -> bool) -> io::Result<bool> {
    let dir = proc.join(pid.to_string());
    let maps = fs::File::open(dir.join("maps"))?;
    for line in BufReader::new(maps).lines() {
        if maps_line(&line?) {
            return Ok(true);
        }
    }
    for entry in fs::read_dir(dir.join("fd"))? {
        // A descriptor closed while we look is no error.
        let Ok(entry) = entry else { continue };
        if let Ok(target) = fs::read_link(entry.path())
            && is_nvidia_device(&target.to_string_lossy())
        {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The driver library (`libcuda.so*`) this process has loaded, as its maps name it.
pub fn loaded_driver() -> Option<std::path::PathBuf> {
    let maps = fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().filter_map(maps_path).find(|path| is_driver_library(path)).map(Into::into)
}

/// The path of one line of `/proc/PID/maps` (`start-end perms offset dev inode   path`): the
/// rest of the line after five single-space-separated fields, padded with spaces; it may
/// itself contain spaces.
fn maps_path(line: &str) -> Option<&str> {
    line.splitn(6, ' ').nth(5).map(str::trim_start)
}

fn is_driver_library(path: &str) -> bool {
    path.rsplit('/').next().unwrap_or(path).starts_with("libcuda.so")
}

fn maps_line_is_cuda(line: &str) -> bool {
    maps_path(line).is_some_and(|path| is_driver_library(path) || is_nvidia_device(path))
}

/// One line of `/proc/PID/maps` mapping an NVIDIA device file.
fn maps_line_is_device(line: &str) -> bool {
    maps_path(line).is_some_and(is_nvidia_device)
}

/// `/dev/nvidia0`, `/dev/nvidiactl`, `/dev/nvidia-uvm`, `/dev/nvidia-caps/...`.
fn is_nvidia_device(path: &str) -> bool {
    path.starts_with("/dev/nvidia")
}

/// The GPUs (by device minor number) that `pids` hold open as `/dev/nvidiaN`.
pub fn open_gpu_minors(pids: &[i32]) -> Vec<u32> {
    let mut minors: Vec<u32> = pids
        .iter()
        .filter_map(|pid| stasis_linux::proc::fd_targets(*pid).ok())
        .flatten()
        .filter_map(|(_, target)| target.to_str()?.strip_prefix("/dev/nvidia")?.parse().ok())
        .collect();
    minors.sort_unstable();
    minors.dedup();
    minors
}

/// The UUID of the GPU with device minor `minor`, from the driver's /proc files.
pub fn uuid_of_minor(minor: u32) -> Option<String> {
    let dirs = std::fs::read_dir("/proc/driver/nvidia/gpus").ok()?;
    dirs.filter_map(|d| std::fs::read_to_string(d.ok()?.path().join("information")).ok()).find_map(|info| {
        let field = |name: &str| info.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
        (field("Device Minor:")? == minor.to_string())
            .then(|| field("GPU UUID:").map(str::to_string))
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines() {
        let cuda = "7f2a4c000000-7f2a4c2a0000 r--p 00000000 08:01 1311 /usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05";
        let dev = "7f2a50000000-7f2a50200000 rw-s 00000000 00:05 618 /dev/nvidia0";
        let uvm = "200000000-200200000 ---p 00000000 00:05 620 /dev/nvidia-uvm";
        let cudart = "7f2a4c000000-7f2a4c2a0000 r-xp 00000000 08:01 1311 /opt/lib/libcudart.so.13";
        let anon = "7ffd1c000000-7ffd1c021000 rw-p 00000000 00:00 0 ";
        let heap = "55d0e0a00000-55d0e0a21000 rw-p 00000000 00:00 0 [heap]";
        let spaced = "7f2a4c000000-7f2a4c2a0000 r--p 00000000 08:01 1311                       /opt/my libs/libcuda.so.1 (deleted)";
        assert!(maps_line_is_cuda(cuda));
        assert!(maps_line_is_cuda(dev));
        assert!(maps_line_is_cuda(uvm));
        assert!(maps_line_is_cuda(spaced));
        assert!(!maps_line_is_cuda(cudart));
        assert!(!maps_line_is_cuda(anon));
        assert!(!maps_line_is_cuda(heap));
        assert!(!maps_line_is_cuda(""));
    }

    #[test]
    fn this_process_does_not_use_cuda() {
        let me = i32::try_from(std::process::id()).unwrap();
        assert_eq!(cuda_candidates(&[me]), Vec::<i32>::new());
    }

    #[test]
    fn missing_pids_are_skipped() {
        // Beyond any pid_max, so it cannot exist.
        assert!(cuda_candidates(&[i32::MAX, -1]).is_empty());
    }

    #[test]
    fn finds_a_process_with_an_nvidia_mapping_in_a_fake_proc() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("42");
        fs::create_dir_all(dir.join("fd")).unwrap();
        fs::write(dir.join("maps"), "1000-2000 r--p 00000000 08:01 7 /usr/lib64/libcuda.so.1\n").unwrap();
        assert!(scan(root.path(), 42, maps_line_is_cuda).unwrap());
        assert!(!scan(root.path(), 42, maps_line_is_device).unwrap(), "libcuda is no device file");

        fs::write(dir.join("maps"), "1000-2000 r--p 00000000 08:01 7 /usr/lib/libc.so.6\n").unwrap();
        assert!(!scan(root.path(), 42, maps_line_is_cuda).unwrap());
        std::os::unix::fs::symlink("/dev/nvidiactl", dir.join("fd").join("3")).unwrap();
        assert!(scan(root.path(), 42, maps_line_is_cuda).unwrap());
        assert!(scan(root.path(), 42, maps_line_is_device).unwrap());
    }

    #[test]
    fn nothing_open_without_a_gpu() {
        assert!(open_gpu_minors(&[std::process::id() as i32]).is_empty());
    }
}
