//! A JVM program (tests/workloads/Threads.java, default-jre-headless) with 200 counting threads
//! and 64 MiB of heap, asked over a line protocol; a client connection kept open, idle, across
//! the checkpoint.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use stasis_tests::corpus::{Case, Memory, Phase, Program, Tree};
use stasis_tests::{TIMEOUT, complete_lines, expect_within, free_port, installed, workload_script};

const CASE: Case = Case {
    program: "JVM, 200 threads",
    note: "200 counting threads and 64 MiB of heap; an idle client connection used after the restore",
    set_up: Jvm::set_up,
    known_gaps: &[],
};

const THREADS: u64 = 200;
const HEAP_MIB: u64 = 64;
/// How long the JVM's memory holds still before a checkpoint: longer than the 5 s after which
/// it hands back its JIT compilers' scratch memory (its chunk pool's cleaning period).
const SETTLE: Duration = Duration::from_secs(6);

case_tests!(CASE);

struct Jvm {
    java: String,
    port: u16,
    kept: Option<BufReader<TcpStream>>,
    /// The heap's checksum, and the ticks last seen.
    heap: String,
    ticks: u64,
}

impl Jvm {
    fn set_up(_dir: &Path) -> Result<Box<dyn Program>, String> {
        let java = installed("java").ok_or("java is not installed (Debian's default-jre-headless)")?;
        Ok(Box::new(Jvm { java, port: free_port(), kept: None, heap: String::new(), ticks: 0 }))
    }

    /// `stat` over `conn`: the live counting threads, the ticks, the heap's checksum.
    fn stat(conn: &mut BufReader<TcpStream>) -> (u64, u64, String) {
        conn.get_mut().write_all(b"stat\n").expect("asking the JVM");
        let mut line = String::new();
        conn.read_line(&mut line).expect("the JVM's answer");
        let words: Vec<&str> = line.split_whitespace().collect();
        let ["threads", live, "ticks", ticks, "heap", heap] = words[..] else {
            panic!("the JVM answered {line:?}")
        };
        (live.parse().expect("threads"), ticks.parse().expect("ticks"), heap.to_owned())
    }

    fn connect(&self) -> BufReader<TcpStream> {
        let stream = TcpStream::connect(("127.0.0.1", self.port)).expect("a connection to the JVM");
        stream.set_read_timeout(Some(TIMEOUT)).expect("a read timeout");
        BufReader::new(stream)
    }

    /// Checks one answer: every thread counts, the ticks went on, the heap is as built.
    fn assert_stat(&mut self, answer: (u64, u64, String), what: &str) {
        let (live, ticks, heap) = answer;
        assert_eq!(live, THREADS, "{what}: every counting thread is alive");
        assert!(ticks >= self.ticks, "{what}: the counters went back from {} to {ticks}", self.ticks);
        assert_eq!(heap, self.heap, "{what}: the heap is as it was built");
        self.ticks = ticks;
    }
}

impl Program for Jvm {
    fn argv(&self) -> Vec<String> {
        let source = workload_script("Threads.java");
        let args = [self.port.to_string(), THREADS.to_string(), HEAP_MIB.to_string()];
        [self.java.clone(), "-XX:-UsePerfData".into(), "-Xmx256m".into(), source]
            .into_iter()
            .chain(args)
            .collect()
    }

    fn populate(&mut self, tree: &Tree) {
        expect_within(TIMEOUT * 3, "the JVM's `ready`", || {
            complete_lines(&tree.log).iter().any(|l| l == "ready").then_some(())
        });
        let mut conn = self.connect();
        let (_, ticks, heap) = Self::stat(&mut conn);
        (self.heap, self.ticks) = (heap, ticks);
        self.kept = Some(conn);
    }

    fn check(&mut self, _tree: &Tree, phase: Phase) {
        if phase == Phase::Restored {
            // The restored counters go on from the checkpoint's, below the ticks seen since.
            self.ticks = 0;
        }
        let kept = self.kept.as_mut().map(Self::stat);
        if let Some(answer) = kept {
            self.assert_stat(answer, "the connection kept open");
        }
        let mut conn = self.connect();
        let first = Self::stat(&mut conn);
        self.assert_stat(first, "a new connection");
        expect_within(TIMEOUT, "the counters to go on", || {
            let (_, ticks, _) = Self::stat(&mut conn);
            (ticks > self.ticks).then_some(())
        });
    }

    /// A young JVM holds a few MiB of its compilers' scratch memory for a second or two and
    /// then hands it back on its own (seen here: 157.3 MiB for 1.6 s, then 152.7 MiB, with no
    /// checkpoint at all). Checkpointed before that, its memory would seem to shrink across
    /// the restore by what it freed, so the checkpoint waits until the memory held still
    /// (within 0.5 %) for [`SETTLE`].
    fn before_checkpoint(&mut self, tree: &Tree) {
        let mut still = (Instant::now(), Memory::of_tree(tree.root).held);
        expect_within(TIMEOUT * 3, "the JVM's memory to hold still", || {
            let held = Memory::of_tree(tree.root).held;
            if held.abs_diff(still.1) * 200 > still.1 {
                still = (Instant::now(), held);
            }
            (still.0.elapsed() >= SETTLE).then_some(())
        });
    }

    fn disconnect(&mut self) {
        self.kept = None;
    }
}
