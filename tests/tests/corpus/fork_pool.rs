//! A multiprocessing fork pool (tests/workloads/fork_pool.py): three workers read 200 MiB the
//! parent built before forking, shared copy-on-write; each digests all of it on request.

use std::path::Path;

use nix::sys::signal::Signal;
use stasis_tests::corpus::{Case, Phase, Program, Tree};
use stasis_tests::{TIMEOUT, complete_lines, expect_within, procfs, python_workload};

const CASE: Case = Case {
    program: "multiprocessing fork pool",
    note: "3 workers read 200 MiB their parent built before forking, shared copy-on-write",
    set_up: ForkPool::set_up,
    known_gaps: &[],
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

/// How many `sums N d1 d2 d3` lines the pool has printed, and the digests of the last. (Not
/// its round N: a tree restored from a checkpoint taken with --leave-running counts its
/// rounds from where the checkpoint was, below those its original printed meanwhile.)
fn last_sums(tree: &Tree) -> (usize, Vec<String>) {
    let lines = complete_lines(&tree.log);
    let sums: Vec<&str> = lines.iter().filter_map(|l| l.strip_prefix("sums ")).collect();
    let digests = sums.last().map(|l| l.split_whitespace().skip(1).map(str::to_owned).collect());
    (sums.len(), digests.unwrap_or_default())
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
        let (before, _) = last_sums(tree);
        procfs::signal(tree.main_pid(), Signal::SIGUSR1);
        let (_, sums) = expect_within(TIMEOUT, "the workers' digests", || {
            Some(last_sums(tree)).filter(|(printed, _)| *printed > before)
        });
        assert_eq!(sums.len(), WORKERS, "one digest per worker: {sums:?}");
        assert!(sums.iter().all(|s| *s == self.built), "each worker reads the memory as built: {sums:?}");
    }
}
