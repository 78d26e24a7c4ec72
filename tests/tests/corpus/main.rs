//! The compatibility corpus (issue 24): real programs from Debian's packages, started under
//! `stasis run` and outside stasis (checkpointed by pid, and by plain CRIU for comparison),
//! each evicted, checkpointed and left running, and restored lazily, then checked by its own
//! client for its data and behaviour, and by the restored tree's total PSS (within 5 % of what
//! it was). The harness is `stasis_tests::corpus`; each module here is one program, with its
//! two tests. A program that is not installed is skipped, saying so (scripts/test.sh installs
//! them all). Results go to target/compat/, for scripts/compat-table.sh.

#![forbid(unsafe_code)]

/// The two tests of a case: started under `stasis run` and checkpointed by workload name, and
/// started outside stasis and checkpointed by pid.
macro_rules! case_tests {
    ($case:expr) => {
        #[test]
        fn under_stasis_run() {
            stasis_tests::skip_unless_ready!();
            $case.under_stasis_run();
        }

        #[test]
        fn by_pid() {
            stasis_tests::skip_unless_ready!();
            $case.by_pid();
        }
    };
}

mod fork_pool;
mod jvm;
mod memcached;
mod nginx;
mod node;
mod postgresql;
mod redis;
mod sqlite;
mod tmux;
