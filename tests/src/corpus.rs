//! The compatibility corpus (issue 24): real programs from Debian's packages, each
//! checkpointed and restored in every way stasis offers, and checked by its own client.
//!
//! A case is a [`Program`]: how to start it, how to fill it with data through its own client,
//! and how to check, with that client, that the data is there and that it serves new requests.
//! [`Case::under_stasis_run`] starts it with `stasis run`, [`Case::by_pid`] outside stasis
//! (checkpointed by pid, and also dumped and restored by plain CRIU for comparison). Each
//! start runs every [`Mode`] on a fresh instance: an eviction, a checkpoint left running (the
//! program keeps serving; then it is killed and restored), and an eviction restored lazily.
//! After each restore the program's check runs, and the tree's memory must be within
//! [`PSS_TOLERANCE`] of what it was before the checkpoint (see [`Outcome::beyond_bound`]).
//!
//! Where stasis fails, the case's plain CRIU result decides: if plain CRIU restores it, stasis
//! has a bug; if it cannot either, stasis must have refused the checkpoint up front, with the
//! reason, leaving the program running. Every result is written as a JSON line under
//! `target/compat/`, from which `scripts/compat-table.sh` makes the README's table.

mod driver;
mod outside;
mod plain_criu;
mod report;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use crate::{Daemon, TIMEOUT, expect_within, procfs};
use driver::{Driver, StasisByPid, StasisRun};
use plain_criu::PlainCriu;
pub use report::{Memory, Outcome};

/// How far the restored tree's PSS may be from what it was before the checkpoint.
pub const PSS_TOLERANCE: f64 = 0.05;

/// A program of the corpus, set up in a directory of its own.
pub trait Program {
    /// The command line that starts it in the foreground (not daemonized).
    fn argv(&self) -> Vec<String>;
    /// Waits until it serves, then writes its data through its own client and opens the
    /// client connections that stay open, idle, across the checkpoint.
    fn populate(&mut self, tree: &Tree);
    /// Checks with its own client that the data [`Program::populate`] wrote is there, that the
    /// connections kept open work, and that it serves new requests. In
    /// [`Phase::LeftRunning`] the check must change nothing that the restore of the
    /// checkpoint just taken depends on (the files it has open, their sizes).
    fn check(&mut self, tree: &Tree, phase: Phase);
    /// Called right before each checkpoint, once [`Program::check`] passed (Redis starts a
    /// background save here, so that the checkpoint finds its child at work).
    fn before_checkpoint(&mut self, _tree: &Tree) {}
    /// Closes the client connections kept open: a tree left running is killed before its
    /// checkpoint is restored, and a connection of a killed process is closed under the
    /// client. The next check opens new ones.
    fn disconnect(&mut self) {}
    /// After a restore's check: what changes the tree's shape (a background save that must
    /// end, its child exiting).
    fn settle(&mut self, _tree: &Tree) {}
}

/// When [`Program::check`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// After [`Program::populate`], before any checkpoint.
    Populated,
    /// After a checkpoint left running; the checkpoint will be restored later.
    LeftRunning,
    /// After a restore.
    Restored,
}

/// How a case is checkpointed and restored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Checkpoint without --leave-running (the tree goes), then restore.
    Eviction,
    /// Checkpoint with --leave-running: the tree serves on; then it is killed and restored.
    LeftRunning,
    /// Eviction, then `restore --lazy`, waiting until the memory is resident.
    Lazy,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Eviction, Mode::LeftRunning, Mode::Lazy];

    /// Its name in the table and the results.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Eviction => "eviction",
            Mode::LeftRunning => "left running",
            Mode::Lazy => "lazy",
        }
    }
}

/// A running instance of a program: the root of its process tree, and where its stdout and
/// stderr go.
#[derive(Debug, Clone)]
pub struct Tree {
    pub root: i32,
    pub log: PathBuf,
}

impl Tree {
    /// The process running the program's command (below stasis-init under `stasis run`).
    pub fn main_pid(&self) -> i32 {
        procfs::command_of(self.root)
    }

    /// The tree's processes, its root first.
    pub fn pids(&self) -> Vec<i32> {
        std::iter::once(self.root).chain(procfs::descendants(self.root)).collect()
    }

    /// The processes of the program's command: the main one and its descendants.
    pub fn program_pids(&self) -> Vec<i32> {
        let main = self.main_pid();
        std::iter::once(main).chain(procfs::descendants(main)).collect()
    }

    /// Waits until the program's command has `n` processes (itself included); returns them.
    pub fn wait_processes(&self, n: usize) -> Vec<i32> {
        expect_within(TIMEOUT, &format!("{n} processes in the tree of {}", self.root), || {
            let pids = self.program_pids();
            (pids.len() == n).then_some(pids)
        })
    }
}

/// A program of the corpus, as its tests name it.
pub struct Case {
    /// Its name in the compatibility table.
    pub program: &'static str,
    /// What the case holds and checks, for the table's notes.
    pub note: &'static str,
    /// Sets the program up in `dir` (empty, its own); `Err(why)` when it is not installed.
    pub set_up: fn(&Path) -> Result<Box<dyn Program>, String>,
    /// Modes that plain CRIU cannot restore either and that stasis cannot yet refuse up front,
    /// with the reason (issue 24's open gaps): their failure is reported, not failed on, as
    /// long as plain CRIU fails too. Stasis restoring one is fine.
    pub known_gaps: &'static [(Mode, &'static str)],
}

impl Case {
    /// Runs every mode with the program started by `stasis run` and checkpointed by workload
    /// name; fails unless each restores with its data within the PSS bound, or is refused up
    /// front where plain CRIU fails too.
    pub fn under_stasis_run(&self) {
        let d = Daemon::start();
        let mut stasis = StasisRun::new(&d, self.slug());
        self.run_modes(&d, &mut stasis, false);
    }

    /// Runs every mode with the program started outside stasis and checkpointed by pid, and
    /// the same with plain CRIU; fails as [`Case::under_stasis_run`] does.
    pub fn by_pid(&self) {
        let d = Daemon::start();
        self.run_modes(&d, &mut StasisByPid::new(&d), true);
    }

    /// The case's name in file names.
    fn slug(&self) -> String {
        self.program.to_lowercase().replace(|c: char| !c.is_ascii_alphanumeric(), "-")
    }

    fn run_modes(&self, d: &Daemon, stasis: &mut impl Driver, always_plain: bool) {
        let mut report = report::Report::new(self, stasis.start_name());
        let mut failures = Vec::new();
        for mode in Mode::ALL {
            let dir = |tool: &str| d.dir().join(format!("{}-{tool}", mode.name().replace(' ', "-")));
            let Some(outcome) = self.attempt(stasis, mode, &dir("stasis")) else { return };
            report.row(stasis.start_name(), mode, &outcome);
            let plain = (always_plain || !outcome.within_bound())
                .then(|| self.attempt(&mut PlainCriu::default(), mode, &dir("criu")))
                .flatten();
            if let Some(plain) = &plain {
                report.row("plain CRIU", mode, plain);
            }
            if let Err(why) = report::judge(&outcome, plain.as_ref()) {
                let known = self.known_gaps.iter().find(|(m, _)| *m == mode).map(|(_, gap)| gap);
                let failing = format!("{} ({}), {}: {why}", self.program, stasis.start_name(), mode.name());
                match known {
                    Some(gap) if plain.as_ref().is_some_and(|p| !p.within_bound()) => {
                        eprintln!("known gap, not failed on: {failing} ({gap})");
                    }
                    _ => failures.push(failing),
                }
            }
        }
        assert!(failures.is_empty(), "the corpus fails:\n{}", failures.join("\n"));
    }

    /// One mode on a fresh instance set up in `dir`; `None` when the program is not installed.
    fn attempt(&self, driver: &mut impl Driver, mode: Mode, dir: &Path) -> Option<Outcome> {
        std::fs::create_dir_all(dir).expect("a directory for the case");
        let mut program = match (self.set_up)(dir) {
            Ok(program) => program,
            Err(why) => {
                eprintln!("skipping {}: {why} (scripts/test.sh installs it)", self.program);
                return None;
            }
        };
        eprintln!("--- {}: {} ({}) ---", self.program, mode.name(), driver.start_name());
        let mut tree = None;
        let outcome =
            catch_unwind(AssertUnwindSafe(|| one_mode(driver, program.as_mut(), mode, dir, &mut tree)));
        if let Some(tree) = tree {
            outside::kill_tree(tree.root);
        }
        let outcome = outcome.unwrap_or_else(|panic| Outcome::Failed(report::panic_text(panic.as_ref())));
        eprintln!("{}, {}: {outcome:?}", self.program, mode.name());
        Some(outcome)
    }
}

/// Starts `program`, fills it, checkpoints and restores it in `mode` with `driver`, checks it
/// and measures it. Keeps the running tree in `tree` for the caller to kill; panics on a
/// failure.
fn one_mode(
    driver: &mut impl Driver,
    program: &mut dyn Program,
    mode: Mode,
    dir: &Path,
    tree: &mut Option<Tree>,
) -> Outcome {
    let running = tree.insert(driver.start(&program.argv(), dir));
    program.populate(running);
    program.check(running, Phase::Populated);
    program.before_checkpoint(running);
    let pids = running.pids();
    let before = Memory::steady(running.root);
    let id = match driver.checkpoint(running, mode == Mode::LeftRunning) {
        Ok(id) => id,
        Err(reason) => {
            let stopped = stopped(&pids);
            assert!(stopped.is_empty(), "the checkpoint failed ({reason}) and left {stopped:?} stopped");
            program.check(running, Phase::Populated);
            // What stasis refuses up front it refuses before CRIU runs; a dump that CRIU gave
            // up on froze the tree first.
            assert!(
                !reason.contains("CRIU dump failed"),
                "not refused up front: CRIU froze the tree and failed: {reason}"
            );
            return Outcome::Refused(reason);
        }
    };
    if mode == Mode::LeftRunning {
        let stopped = stopped(&pids);
        assert!(stopped.is_empty(), "processes {stopped:?} do not run on after checkpoint --leave-running");
        program.check(running, Phase::LeftRunning);
        program.disconnect();
        outside::kill_tree(running.root);
    }
    driver.wait_gone(&pids);
    driver.restore(running, &id, mode == Mode::Lazy);
    // Measured as the restore leaves the tree, before the check makes it touch anything (a
    // parent that writes breaks the copy-on-write sharing with its children, restored or not).
    let after = Memory::steady(running.root);
    program.check(running, Phase::Restored);
    program.settle(running);
    Outcome::Restored { before, after }
}

/// Those of `pids` that are stopped (frozen or traced); processes that ended since (a backend
/// whose client left) are not.
fn stopped(pids: &[i32]) -> Vec<i32> {
    pids.iter().copied().filter(|&p| matches!(procfs::proc_state(p), Some('T' | 't'))).collect()
}
