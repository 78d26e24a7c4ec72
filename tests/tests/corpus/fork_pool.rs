//! A multiprocessing fork pool (tests/workloads/fork_pool.py): three workers read 200 MiB the
//! parent built before forking, shared copy-on-write; each digests all of it on request.

use std::path::Path;

use nix::sys::signal::Signal;
use stasis_tests::corpus::{Case, Mode, Phase, Program, Tree};
use stasis_tests::{TIMEOUT, complete_lines, expect_within, procfs, python_workload};

const CASE: Case = Case {
    program: "multiprocessing fork pool",
    note: "3 workers read 200 MiB their parent built before forking, shared copy-on-write",
    set_up: ForkPool::set_up,
    known_gaps: &[(
        Mode::LeftRunning,
        "the pool's locks are POSIX semaphores in a deleted /dev/shm file, which the tree left running goes \
         on changing; CRIU restores the file as it is then, not as it was (plain CRIU: the pool deadlocks)",
    )],
};

const MIB: u64 = 200;
const WORKERS: usize = 3;

case_tests!(CASE);

struct ForkPool {
    /// The digest of the memory as the parent built it.
    built: String,
}

impl ForkPool {
    fn set_up(_dir: &Path) -> Result<Box<dyn Program>, String> {
        Ok(Box::new(ForkPool { built: String::new() }))
    }
}

/// The pool's last `sums N d1 d2 d3` line: the round and the digests.
fn last_sums(tree: &Tree) -> Option<(u64, Vec<String>)> {
    let lines = complete_lines(&tree.log);
    let line = lines.iter().rev().find_map(|l| l.strip_prefix("sums "))?;
    let mut words = line.split_whitespace();
    let round = words.next()?.parse().ok()?;
    Some((round, words.map(str::to_owned).collect()))
}

impl Program for ForkPool {
    fn argv(&self) -> Vec<String> {
        python_workload("fork_pool.py", &[&MIB.to_string(), &WORKERS.to_string()])
    }

    fn populate(&mut self, tree: &Tree) {
        expect_within(TIMEOUT * 3, "the pool to be ready", || {
            complete_lines(&tree.log).iter().any(|l| l == "ready").then_some(())
        });
        let lines = complete_lines(&tree.log);
        self.built = lines.iter().find_map(|l| l.strip_prefix("built ")).expect("the digest").to_owned();
    }

    fn check(&mut self, tree: &Tree, _phase: Phase) {
        let before = last_sums(tree).map_or(0, |(round, _)| round);
        procfs::signal(tree.main_pid(), Signal::SIGUSR1);
        let (_, sums) = expect_within(TIMEOUT, "the workers' digests", || {
            last_sums(tree).filter(|(round, _)| *round > before)
        });
        assert_eq!(sums.len(), WORKERS, "one digest per worker: {sums:?}");
        assert!(sums.iter().all(|s| *s == self.built), "each worker reads the memory as built: {sums:?}");
    }
}
