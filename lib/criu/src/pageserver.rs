//! The receiving side of CRIU's page-server protocol, run inside stasisd on our end of the
//! socketpair whose other end CRIU gets as `ps.fd`.
//!
//! Every command starts with a header in native byte order, whose page count widened in
//! CRIU 4.2:
//!
//! ```text
//!  CRIU < 4.2 (24 bytes)        CRIU >= 4.2 (32 bytes)
//!  0  u32  command | flags<<16   0  u32  command | flags<<16, then 4 bytes of padding
//!  4  u32  number of pages       8  u64  number of pages
//!  8  u64  virtual address      16  u64  virtual address
//! 16  u64  destination          24  u64  destination: (id << 8) | type (1 task, 2 shmem)
//! ```
//!
//! `OPEN2` is answered with one byte, "has parent": 1 when the dump tracks dirty pages and the
//! tree's previous checkpoint has that pagemap, so that CRIU sends pages unchanged since then as
//! "in parent" runs without data (`ADD_F` with the parent flag, or `HOLE`); 0 otherwise, and
//! CRIU sends every page. An in-parent run is accepted only for such a pagemap and only where
//! the previous checkpoint holds its pages. `PARENT` is answered with a 4-byte int, and
//! `CLOSE`/`FORCE_CLOSE` with a 4-byte zero once everything is received and the sink closed.
//! `ADD_F` with the present flag is followed by the pages' bytes. Nothing else is answered.
//!
//! `OPEN`/`OPEN2` name a pagemap CRIU's restore will want, whether or not any page of it
//! follows: a shared anonymous mapping never written has none, and its pagemap must still
//! exist (empty) for the restore. So the sink hears of every one.

use std::io::{self, Read, Write};

use stasis_criu_images::pages::{InParent, PAGE_SIZE, PE_PARENT, PE_PRESENT, PageRun, PageSink};

const IOV_ADD: u32 = 1;
const IOV_HOLE: u32 = 2;
pub(super) const IOV_OPEN: u32 = 3;
pub(super) const IOV_OPEN2: u32 = 4;
const IOV_PARENT: u32 = 5;
pub(super) const IOV_ADD_F: u32 = 6;
pub(super) const IOV_CLOSE: u32 = 0x1023;
const IOV_FORCE_CLOSE: u32 = 0x1024;

/// The header layout of the CRIU in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderLayout {
    /// `u32` page count: CRIU before 4.2.
    Narrow,
    /// `u64` page count: CRIU 4.2 and later.
    Wide,
}

impl HeaderLayout {
    pub fn for_version(major: i32, minor: i32) -> Self {
        if (major, minor) >= (4, 2) { Self::Wide } else { Self::Narrow }
    }

    pub(super) fn len(self) -> usize {
        match self {
            Self::Narrow => 24,
            Self::Wide => 32,
        }
    }

    /// A header: command word, page count, address, destination (as CRIU sends them).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn encode(self, cmd: u32, nr_pages: u64, vaddr: u64, dst_id: u64) -> Vec<u8> {
        let mut h = cmd.to_ne_bytes().to_vec();
        match self {
            Self::Narrow => h.extend((nr_pages as u32).to_ne_bytes()),
            Self::Wide => {
                h.extend([0; 4]);
                h.extend(nr_pages.to_ne_bytes());
            }
        }
        h.extend(vaddr.to_ne_bytes());
        h.extend(dst_id.to_ne_bytes());
        h
    }

    /// (command word, page count, address, destination) of a header.
    pub(super) fn parse(self, h: &[u8]) -> (u32, u64, u64, u64) {
        let u32_at = |at: usize| u32::from_ne_bytes(h[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_ne_bytes(h[at..at + 8].try_into().expect("8 bytes"));
        match self {
            Self::Narrow => (u32_at(0), u64::from(u32_at(4)), u64_at(8), u64_at(16)),
            Self::Wide => (u32_at(0), u64_at(8), u64_at(16), u64_at(24)),
        }
    }
}

/// Largest run accepted in one command; CRIU sends at most a pipe's worth.
const MAX_RUN_PAGES: u64 = 1 << 20;

/// The page-server session failed.
#[derive(Debug, thiserror::Error)]
pub enum PageServerError {
    #[error("page-server connection failed")]
    Io(#[source] io::Error),
    #[error("CRIU closed the page-server connection before flushing its pages")]
    Unflushed,
    #[error("unexpected page-server command {cmd:#x}")]
    BadCommand { cmd: u32 },
    #[error("CRIU opened pagemap {dst_id:#x}, of a kind stasis does not know")]
    BadDestination { dst_id: u64 },
    #[error("page run of {nr_pages} pages at {vaddr:#x} is out of bounds")]
    BadRun { vaddr: u64, nr_pages: u64 },
    #[error(
        "CRIU sent {nr_pages} pages at {vaddr:#x} of pagemap {dst_id:#x} as unchanged since the \
         previous checkpoint, which does not hold them"
    )]
    NotInParent { dst_id: u64, vaddr: u64, nr_pages: u64 },
    #[error("storing received pages failed")]
    Sink(#[source] io::Error),
}

/// Totals of one session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReceiveStats {
    pub runs: u64,
    pub bytes: u64,
}

/// Serves one dump's page-server session on `conn` until CRIU closes it; `parent` is the
/// tree's previous checkpoint when the dump tracks dirty pages.
pub fn serve<C: Read + Write>(
    conn: &mut C,
    layout: HeaderLayout,
    sink: &mut dyn PageSink,
    parent: Option<&dyn InParent>,
) -> Result<ReceiveStats, PageServerError> {
    let mut stats = ReceiveStats::default();
    // Pagemaps answered "has parent".
    let mut with_parent = std::collections::HashSet::new();
    let mut buf = [0u8; 32];
    let header = &mut buf[..layout.len()];
    loop {
        if let Err(e) = conn.read_exact(header) {
            return Err(match e.kind() {
                io::ErrorKind::UnexpectedEof => PageServerError::Unflushed,
                _ => PageServerError::Io(e),
            });
        }
        let (raw, nr_pages, vaddr, dst_id) = layout.parse(header);
        let (cmd, flags) = (raw & 0xffff, raw >> 16);
        let run = |flags| PageRun { dst_id, vaddr, nr_pages, flags };
        match cmd {
            IOV_OPEN | IOV_OPEN2 => {
                if stasis_criu_images::images::pagemap_file_name(dst_id).is_none() {
                    return Err(PageServerError::BadDestination { dst_id });
                }
                sink.open(dst_id).map_err(PageServerError::Sink)?;
                if cmd == IOV_OPEN2 {
                    let has = parent.is_some_and(|p| p.has(dst_id));
                    if has {
                        with_parent.insert(dst_id);
                    }
                    conn.write_all(&[u8::from(has)]).map_err(PageServerError::Io)?;
                }
            }
            IOV_PARENT => conn.write_all(&0i32.to_ne_bytes()).map_err(PageServerError::Io)?,
            IOV_ADD | IOV_ADD_F | IOV_HOLE => {
                let flags = match cmd {
                    IOV_ADD => PE_PRESENT,
                    IOV_HOLE => PE_PARENT,
                    _ => flags,
                };
                if nr_pages == 0 || nr_pages > MAX_RUN_PAGES || vaddr % PAGE_SIZE != 0 {
                    return Err(PageServerError::BadRun { vaddr, nr_pages });
                }
                let run = run(flags);
                if run.flags & PE_PARENT != 0
                    && !(with_parent.contains(&dst_id) && parent.is_some_and(|p| p.covers(&run)))
                {
                    return Err(PageServerError::NotInParent { dst_id, vaddr, nr_pages });
                }
                sink.run(run, conn).map_err(PageServerError::Sink)?;
                stats.runs += 1;
                if run.has_data() {
                    stats.bytes += run.byte_len();
                }
            }
            IOV_CLOSE | IOV_FORCE_CLOSE => {
                sink.close().map_err(PageServerError::Sink)?;
                conn.write_all(&0i32.to_ne_bytes()).map_err(PageServerError::Io)?;
                return Ok(stats);
            }
            _ => return Err(PageServerError::BadCommand { cmd: raw }),
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use stasis_criu_images::pages::PE_LAZY;

    /// A scripted peer: what CRIU sends, and what we answer.
    pub struct Wire {
        pub input: io::Cursor<Vec<u8>>,
        pub output: Vec<u8>,
    }

    impl Read for Wire {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.input.read(buf)
        }
    }

    impl Write for Wire {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.output.write(buf)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    pub fn header(cmd: u32, nr_pages: u64, vaddr: u64, dst_id: u64) -> Vec<u8> {
        HeaderLayout::Wide.encode(cmd, nr_pages, vaddr, dst_id)
    }

    fn narrow(cmd: u32, nr_pages: u32, vaddr: u64, dst_id: u64) -> Vec<u8> {
        HeaderLayout::Narrow.encode(cmd, u64::from(nr_pages), vaddr, dst_id)
    }

    #[test]
    fn narrow_headers_of_criu_before_4_2() {
        assert_eq!(HeaderLayout::for_version(4, 1), HeaderLayout::Narrow);
        assert_eq!(HeaderLayout::for_version(4, 2), HeaderLayout::Wide);
        let mut input = narrow(IOV_OPEN2, 0, 0, 257);
        input.extend(narrow(IOV_ADD_F | (PE_PRESENT << 16), 1, 0x5000, 257));
        input.extend(vec![3; PAGE_SIZE as usize]);
        input.extend(narrow(IOV_CLOSE, 0, 0, 0));
        let mut wire = Wire { input: io::Cursor::new(input), output: Vec::new() };
        let mut sink = Collect::default();
        serve(&mut wire, HeaderLayout::Narrow, &mut sink, None).unwrap();
        assert_eq!(sink.0[0].0, PageRun { dst_id: 257, vaddr: 0x5000, nr_pages: 1, flags: PE_PRESENT });
    }

    /// Runs, opened images, and whether the sink was closed; with `.3`, its close fails.
    #[derive(Default)]
    struct Collect(Vec<(PageRun, Vec<u8>)>, Vec<u64>, bool, bool);

    impl PageSink for Collect {
        fn open(&mut self, dst_id: u64) -> io::Result<()> {
            self.1.push(dst_id);
            Ok(())
        }

        fn close(&mut self) -> io::Result<()> {
            self.2 = true;
            if self.3 { Err(io::Error::other("the store stopped")) } else { Ok(()) }
        }

        fn run(&mut self, run: PageRun, data: &mut dyn Read) -> io::Result<()> {
            let mut bytes = vec![0; if run.has_data() { run.byte_len() as usize } else { 0 }];
            data.read_exact(&mut bytes)?;
            self.0.push((run, bytes));
            Ok(())
        }
    }

    #[test]
    fn a_dump_session_is_received_and_answered() {
        let pid_map = (42 << 8) | 1;
        let mut input = header(IOV_OPEN2, 0, 0, pid_map);
        input.extend(header(IOV_ADD_F | ((PE_PRESENT | PE_LAZY) << 16), 2, 0x7000, pid_map));
        input.extend(vec![0xab; 2 * PAGE_SIZE as usize]);
        input.extend(header(IOV_ADD_F | (PE_LAZY << 16), 1, 0x9000, pid_map));
        input.extend(header(IOV_FORCE_CLOSE, 0, 0, 0));
        let mut wire = Wire { input: io::Cursor::new(input), output: Vec::new() };
        let mut sink = Collect::default();
        let stats = serve(&mut wire, HeaderLayout::Wide, &mut sink, None).unwrap();
        assert_eq!(stats, ReceiveStats { runs: 2, bytes: 2 * PAGE_SIZE });
        // One byte for OPEN2, a zero int for the close.
        assert_eq!(wire.output, [0, 0, 0, 0, 0]);
        assert_eq!(
            sink.0[0].0,
            PageRun { dst_id: pid_map, vaddr: 0x7000, nr_pages: 2, flags: PE_PRESENT | PE_LAZY }
        );
        assert!(sink.0[0].1.iter().all(|b| *b == 0xab));
        assert!(!sink.0[1].0.has_data());
        assert_eq!(sink.1, [pid_map]);
        assert!(sink.2, "the sink is closed before the close is answered");
    }

    #[test]
    fn a_sink_that_fails_to_close_leaves_the_close_unanswered() {
        let mut input = header(IOV_OPEN2, 0, 0, 257);
        input.extend(header(IOV_CLOSE, 0, 0, 0));
        let mut wire = Wire { input: io::Cursor::new(input), output: Vec::new() };
        let mut sink = Collect { 3: true, ..Default::default() };
        assert!(matches!(
            serve(&mut wire, HeaderLayout::Wide, &mut sink, None),
            Err(PageServerError::Sink(_))
        ));
        assert_eq!(wire.output, [0], "OPEN2's answer only: CRIU's dump fails");
    }

    #[test]
    fn a_pagemap_opened_without_pages_is_passed_on() {
        // A shared anonymous mapping never written: CRIU opens its pagemap and sends nothing.
        let (task, shmem) = ((42 << 8) | 1, (13285 << 8) | 2);
        let mut input = header(IOV_OPEN2, 0, 0, task);
        input.extend(header(IOV_ADD_F | (PE_PRESENT << 16), 1, 0x7000, task));
        input.extend(vec![1; PAGE_SIZE as usize]);
        input.extend(header(IOV_OPEN, 0, 0, shmem));
        input.extend(header(IOV_CLOSE, 0, 0, 0));
        let mut wire = Wire { input: io::Cursor::new(input), output: Vec::new() };
        let mut sink = Collect::default();
        serve(&mut wire, HeaderLayout::Wide, &mut sink, None).unwrap();
        assert_eq!(sink.1, [task, shmem], "both pagemaps, the empty one too");
        assert_eq!(sink.0.len(), 1);
        // OPEN is not answered, OPEN2 is.
        assert_eq!(wire.output, [0, 0, 0, 0, 0]);

        let mut wire =
            Wire { input: io::Cursor::new(header(IOV_OPEN2, 0, 0, (7 << 8) | 9)), output: Vec::new() };
        assert!(matches!(
            serve(&mut wire, HeaderLayout::Wide, &mut Collect::default(), None),
            Err(PageServerError::BadDestination { dst_id }) if dst_id == (7 << 8) | 9
        ));
    }

    #[test]
    fn eof_before_close_and_garbage_are_errors() {
        let mut wire = Wire { input: io::Cursor::new(header(IOV_OPEN2, 0, 0, 1)), output: Vec::new() };
        assert!(matches!(
            serve(&mut wire, HeaderLayout::Wide, &mut Collect::default(), None),
            Err(PageServerError::Unflushed)
        ));
        let mut wire = Wire { input: io::Cursor::new(header(0x77, 0, 0, 1)), output: Vec::new() };
        assert!(matches!(
            serve(&mut wire, HeaderLayout::Wide, &mut Collect::default(), None),
            Err(PageServerError::BadCommand { .. })
        ));
        let mut wire = Wire { input: io::Cursor::new(header(IOV_ADD_F, 1, 0x1001, 1)), output: Vec::new() };
        assert!(matches!(
            serve(&mut wire, HeaderLayout::Wide, &mut Collect::default(), None),
            Err(PageServerError::BadRun { .. })
        ));
    }

    /// A previous checkpoint holding pages 0x10000..0x20000 of pagemap 257.
    struct Previous;

    impl InParent for Previous {
        fn has(&self, dst_id: u64) -> bool {
            dst_id == 257
        }

        fn covers(&self, run: &PageRun) -> bool {
            run.dst_id == 257 && run.vaddr >= 0x10000 && run.vaddr + run.byte_len() <= 0x20000
        }
    }

    #[test]
    fn runs_in_parent_only_where_the_previous_checkpoint_holds_them() {
        let (task, other) = (257, (43 << 8) | 1);
        let mut input = header(IOV_OPEN2, 0, 0, task);
        input.extend(header(IOV_ADD_F | (PE_PARENT << 16), 4, 0x10000, task));
        input.extend(header(IOV_ADD_F | (PE_PRESENT << 16), 1, 0x14000, task));
        input.extend(vec![5; PAGE_SIZE as usize]);
        input.extend(header(IOV_HOLE, 2, 0x15000, task));
        input.extend(header(IOV_OPEN2, 0, 0, other));
        input.extend(header(IOV_CLOSE, 0, 0, 0));
        let mut wire = Wire { input: io::Cursor::new(input), output: Vec::new() };
        let mut sink = Collect::default();
        serve(&mut wire, HeaderLayout::Wide, &mut sink, Some(&Previous)).unwrap();
        // "Has parent" for the pagemap the previous checkpoint has, not for the other.
        assert_eq!(wire.output, [1, 0, 0, 0, 0, 0]);
        let flags: Vec<u32> = sink.0.iter().map(|(run, _)| run.flags).collect();
        assert_eq!(flags, [PE_PARENT, PE_PRESENT, PE_PARENT]);

        // Past what the previous checkpoint holds; of a pagemap answered 0; with no parent.
        let beyond = header(IOV_ADD_F | (PE_PARENT << 16), 2, 0x1f000, task);
        let unanswered = header(IOV_HOLE, 1, 0x10000, other);
        for (run, parent) in [
            (beyond, Some(&Previous as &dyn InParent)),
            (unanswered.clone(), Some(&Previous as &dyn InParent)),
            (unanswered, None),
        ] {
            let mut input = header(IOV_OPEN2, 0, 0, task);
            input.extend(header(IOV_OPEN2, 0, 0, other));
            input.extend(run);
            let mut wire = Wire { input: io::Cursor::new(input), output: Vec::new() };
            let served = serve(&mut wire, HeaderLayout::Wide, &mut Collect::default(), parent);
            assert!(matches!(served, Err(PageServerError::NotInParent { .. })), "{served:?}");
        }
    }
}
