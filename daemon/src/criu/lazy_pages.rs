//! CRIU's lazy-pages mode, with stasisd as the page server.
//!
//! ```text
//! stasisd ── socketpair ── criu lazy-pages -D dir --page-server --ps-socket FD
//!    │                           │ (one userfaultfd per restored task, over dir/lazy-pages.socket)
//!    └── criu swrk: RESTORE with lazy_pages ──┘
//! ```
//! The restore skips the pages its pagemaps mark lazy (`PE_LAZY` without `PE_PRESENT`); the
//! tree runs at once, and each first touch of such a page faults into the lazy-pages daemon,
//! which asks us for it with `PS_IOV_GET` (address and task pid). Once the restore is done the
//! daemon also pulls every remaining lazy range in the background, in address order, and
//! exits with status 0 when all pages are in. Answers go in request order and may hold fewer
//! pages than asked for: CRIU asks again for the rest.
//!
//! If the daemon goes away before that, the kernel drops the tasks' userfaultfd registration
//! and untouched pages read as zeros: a lazily restored tree whose daemon failed must be
//! killed, never left running (the engine does that).

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use tracing::debug;

use super::CriuError;
use super::pageserver::{
    HeaderLayout, IOV_ADD_F, IOV_CLOSE, IOV_FORCE_CLOSE, IOV_GET, MAX_RUN_PAGES, PAGE_SIZE, PE_PRESENT,
    PageServerError,
};
use crate::linux::sys::{ChildSetup, spawn};

/// The lazy-pages daemon's log, inside the images directory.
pub const LAZY_LOG_FILE: &str = "lazy-pages.log";

/// How long the daemon may take to read the images and listen for the restore.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the pages CRIU asks for come from.
pub trait PageSource {
    /// Appends to `out` the bytes of whole pages of task `pid` from `vaddr` on: at least one
    /// page, at most `max_bytes`.
    fn read(
        &mut self,
        pid: u64,
        vaddr: u64,
        max_bytes: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>>;
}

/// Totals of one lazy session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServeStats {
    pub requests: u64,
    pub bytes: u64,
}

/// Answers the lazy-pages daemon's requests on `conn` until it says goodbye.
pub fn serve_requests<C: Read + Write>(
    conn: &mut C,
    layout: HeaderLayout,
    source: &mut dyn PageSource,
) -> Result<ServeStats, PageServerError> {
    let mut stats = ServeStats::default();
    let mut buf = [0u8; 32];
    let header = &mut buf[..layout.len()];
    let mut pages = Vec::new();
    loop {
        if let Err(e) = conn.read_exact(header) {
            return Err(match e.kind() {
                io::ErrorKind::UnexpectedEof => PageServerError::Hangup,
                _ => PageServerError::Io(e),
            });
        }
        let (raw, nr_pages, vaddr, dst_id) = layout.parse(header);
        match raw & 0xffff {
            IOV_GET => {
                if nr_pages == 0 || nr_pages > MAX_RUN_PAGES || vaddr % PAGE_SIZE != 0 {
                    return Err(PageServerError::BadRun { vaddr, nr_pages });
                }
                pages.clear();
                source
                    .read(dst_id, vaddr, nr_pages * PAGE_SIZE, &mut pages)
                    .map_err(PageServerError::Source)?;
                let got = pages.len() as u64 / PAGE_SIZE;
                if got == 0 || got > nr_pages || !(pages.len() as u64).is_multiple_of(PAGE_SIZE) {
                    let reason = format!("{} bytes for a request of {nr_pages} pages", pages.len());
                    return Err(PageServerError::Source(reason.into()));
                }
                let reply = layout.encode(IOV_ADD_F | (PE_PRESENT << 16), got, vaddr, dst_id);
                conn.write_all(&reply).and_then(|()| conn.write_all(&pages)).map_err(PageServerError::Io)?;
                stats.requests += 1;
                stats.bytes += pages.len() as u64;
            }
            IOV_CLOSE | IOV_FORCE_CLOSE => {
                conn.write_all(&0i32.to_ne_bytes()).map_err(PageServerError::Io)?;
                return Ok(stats);
            }
            _ => return Err(PageServerError::BadCommand { cmd: raw }),
        }
    }
}

/// The pids of `criu lazy-pages` daemons serving the images of any of `dirs`: those a stasisd
/// killed during a lazy restore left behind, waiting for a restore that will never come.
pub fn serving(dirs: &[PathBuf]) -> Vec<i32> {
    crate::linux::proc::all_pids()
        .into_iter()
        .filter(|&pid| {
            let args = crate::linux::proc::cmdline(pid).unwrap_or_default();
            let dir = args.iter().position(|a| a == "-D").and_then(|i| args.get(i + 1));
            args.iter().any(|a| a == "lazy-pages")
                && dir.is_some_and(|d| dirs.iter().any(|ours| Path::new(d) == ours))
        })
        .collect()
}

/// A started `criu lazy-pages` daemon, ready for the restore. stasisd's reaper collects its
/// exit status.
#[derive(Debug)]
pub struct LazyPagesDaemon {
    pub pid: i32,
    pub log: PathBuf,
}

/// Starts `criu` (the program) as lazy-pages daemon on the images in `images_dir`, with
/// `page_server` (a connected stream socket) as its page server, and waits until it is ready.
pub(super) fn start_lazy_pages(
    criu: &Path,
    images_dir: &Path,
    page_server: RawFd,
) -> Result<LazyPagesDaemon, CriuError> {
    {
        let (ready_r, ready_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| CriuError::Io(e.into()))?;
        let mut cmd = Command::new(criu);
        cmd.arg("lazy-pages")
            .arg("-D")
            .arg(images_dir)
            .args(["--page-server", "--ps-socket", &page_server.to_string()])
            .args(["--status-fd", &ready_w.as_raw_fd().to_string()])
            .args(["-o", LAZY_LOG_FILE, "-v4"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let setup = ChildSetup { keep_fds: vec![page_server, ready_w.as_raw_fd()], ..Default::default() };
        let child =
            spawn(&mut cmd, setup).map_err(|source| CriuError::Spawn { path: criu.into(), source })?;
        let daemon = LazyPagesDaemon { pid: child.id() as i32, log: images_dir.join(LAZY_LOG_FILE) };
        drop(child);
        drop(ready_w);
        debug!(pid = daemon.pid, "criu lazy-pages started");
        let failed = |error: CriuError| {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(daemon.pid), nix::sys::signal::SIGKILL);
            Err(error)
        };
        let deadline = std::time::Instant::now() + READY_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let timeout = PollTimeout::try_from(left.as_millis() as i32).unwrap_or(PollTimeout::MAX);
            let mut fds = [PollFd::new(ready_r.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, timeout) {
                Ok(0) => return failed(CriuError::Timeout("lazy-pages daemon", READY_TIMEOUT)),
                Err(nix::Error::EINTR) => continue,
                Err(e) => return failed(CriuError::Io(e.into())),
                Ok(_) => break,
            }
        }
        let mut byte = [0u8; 1];
        match nix::unistd::read(&ready_r, &mut byte) {
            Ok(1) => Ok(daemon),
            _ => failed(CriuError::Exited { log_tail: super::log::tail_of(&daemon.log) }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::pageserver::tests::{Wire, header};
    use super::*;

    /// Pages whose bytes are the low byte of their page number; at most two pages per answer.
    struct Numbered;

    impl PageSource for Numbered {
        fn read(
            &mut self,
            pid: u64,
            vaddr: u64,
            max_bytes: u64,
            out: &mut Vec<u8>,
        ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            if pid != 42 {
                return Err(format!("no task {pid}").into());
            }
            for page in (vaddr / PAGE_SIZE..).take((max_bytes / PAGE_SIZE).min(2) as usize) {
                out.extend(std::iter::repeat_n(page as u8, PAGE_SIZE as usize));
            }
            Ok(())
        }
    }

    #[test]
    fn requests_are_answered_in_order_with_possibly_fewer_pages() {
        let mut input = header(IOV_GET, 1, 0x3000, 42);
        input.extend(header(IOV_GET, 5, 0x7000, 42));
        input.extend(header(IOV_FORCE_CLOSE, 0, 0, 0));
        let mut wire = Wire { input: io::Cursor::new(input), output: Vec::new() };
        let stats = serve_requests(&mut wire, HeaderLayout::Wide, &mut Numbered).unwrap();
        assert_eq!(stats, ServeStats { requests: 2, bytes: 3 * PAGE_SIZE });
        let page = PAGE_SIZE as usize;
        let mut expected = header(IOV_ADD_F | (PE_PRESENT << 16), 1, 0x3000, 42);
        expected.extend(vec![3; page]);
        expected.extend(header(IOV_ADD_F | (PE_PRESENT << 16), 2, 0x7000, 42));
        expected.extend(vec![7; page]);
        expected.extend(vec![8; page]);
        expected.extend(0i32.to_ne_bytes());
        assert_eq!(wire.output, expected);
    }

    #[test]
    fn failures_and_hangups_are_errors() {
        let mut wire = Wire { input: io::Cursor::new(header(IOV_GET, 1, 0x3000, 7)), output: Vec::new() };
        let err = serve_requests(&mut wire, HeaderLayout::Wide, &mut Numbered).unwrap_err();
        assert!(matches!(err, PageServerError::Source(_)), "{err}");
        assert!(wire.output.is_empty(), "nothing is answered for a failed request");
        let mut wire = Wire { input: io::Cursor::new(header(IOV_GET, 1, 0x3000, 42)), output: Vec::new() };
        let err = serve_requests(&mut wire, HeaderLayout::Wide, &mut Numbered).unwrap_err();
        assert!(matches!(err, PageServerError::Hangup), "{err}");
        let mut wire = Wire { input: io::Cursor::new(header(IOV_GET, 1, 0x3001, 42)), output: Vec::new() };
        let err = serve_requests(&mut wire, HeaderLayout::Wide, &mut Numbered).unwrap_err();
        assert!(matches!(err, PageServerError::BadRun { .. }), "{err}");
    }

    #[test]
    fn daemons_left_serving_a_directory_are_found_by_it() {
        let dir = tempfile::tempdir().unwrap();
        let images = dir.path().join("restore-1");
        // A stand-in whose command line reads as a lazy-pages daemon's (the `; true` keeps
        // the shell from replacing itself with sleep).
        let mut child = Command::new("sh")
            .args(["-c", "sleep 30; true", "lazy-pages", "-D"])
            .arg(&images)
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        // Until it has executed sh, the child's command line is still this test's.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !crate::linux::proc::cmdline(pid).unwrap_or_default().iter().any(|a| a == "lazy-pages") {
            assert!(std::time::Instant::now() < deadline, "the stand-in never ran");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(serving(std::slice::from_ref(&images)), [pid]);
        assert!(serving(&[dir.path().join("restore-2")]).is_empty(), "another directory's");
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
