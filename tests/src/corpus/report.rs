//! What a mode came to, whether that is good enough, and the results as JSON lines under
//! `target/compat/` (one file per case and start; scripts/compat-table.sh reads them).

use std::any::Any;
use std::fs::File;
use std::io::Write;
use std::path::PathBuf;

use serde_json::json;

use super::{Case, Mode, PSS_TOLERANCE};
use crate::procfs;

/// A tree's memory, summed over its processes' /proc/PID/smaps_rollup, in KiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memory {
    /// Total proportional set size: memory shared between processes counted once.
    pub pss: u64,
    /// Its anonymous and shared-memory part (`Pss_Anon` + `Pss_Shmem`): what the checkpoint
    /// holds.
    pub held: u64,
}

impl Memory {
    /// The tree rooted at `root`, now.
    pub fn of_tree(root: i32) -> Memory {
        let pids: Vec<i32> = std::iter::once(root).chain(procfs::descendants(root)).collect();
        let sum = |field: &str| pids.iter().filter_map(|&p| procfs::rollup_kib(p, field)).sum::<u64>();
        Memory { pss: sum("Pss"), held: sum("Pss_Anon") + sum("Pss_Shmem") }
    }

    /// The tree's memory once it holds still: a program may be freeing memory on its own
    /// (a garbage collector after a burst of requests). Two measures 250 ms apart within 1 %,
    /// or the last after 5 s.
    pub fn steady(root: i32) -> Memory {
        let mut last = Memory::of_tree(root);
        for _ in 0..20 {
            std::thread::sleep(std::time::Duration::from_millis(250));
            let now = Memory::of_tree(root);
            if now.pss.abs_diff(last.pss) * 100 <= last.pss && now.held.abs_diff(last.held) * 100 <= last.held
            {
                return now;
            }
            last = now;
        }
        last
    }
}

/// What one mode of a case came to.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// Restored, and its check passed; the tree's memory before the checkpoint and after the
    /// restore.
    Restored { before: Memory, after: Memory },
    /// The checkpoint was refused with this reason, and the program ran on, unharmed.
    Refused(String),
    /// Anything else, with what went wrong.
    Failed(String),
}

impl Outcome {
    /// Why a restored tree's memory is out of bounds: its total PSS more than
    /// [`PSS_TOLERANCE`] above what it was, or the part the checkpoint holds (anonymous and
    /// shared memory) more than that off either way. A total below is not held against it:
    /// pages of files (the program, its libraries) come back as the program touches them.
    pub fn beyond_bound(&self) -> Option<String> {
        let Outcome::Restored { before, after } = self else { return None };
        let ratio = |after: u64, before: u64| after as f64 / before.max(1) as f64;
        let (total, held) = (ratio(after.pss, before.pss), ratio(after.held, before.held));
        (total > 1.0 + PSS_TOLERANCE || (held - 1.0).abs() > PSS_TOLERANCE).then(|| {
            format!(
                "the tree's total PSS went from {} KiB to {} KiB (x{total:.3}), its anonymous and \
                 shared memory from {} KiB to {} KiB (x{held:.3}); the bound is {PSS_TOLERANCE}",
                before.pss, after.pss, before.held, after.held
            )
        })
    }

    /// Restored, with its memory within the bound.
    pub fn within_bound(&self) -> bool {
        matches!(self, Outcome::Restored { .. }) && self.beyond_bound().is_none()
    }
}

/// `Ok` when stasis's `outcome` is what the corpus asks for, given plain CRIU's on the same
/// mode (when it was tried); else why not.
pub(super) fn judge(stasis: &Outcome, plain: Option<&Outcome>) -> Result<(), String> {
    let plain_restores = matches!(plain, Some(Outcome::Restored { .. }));
    match stasis {
        Outcome::Restored { .. } => match stasis.beyond_bound() {
            Some(why) => Err(format!("restored, but {why}")),
            None => Ok(()),
        },
        Outcome::Refused(why) if plain_restores => {
            Err(format!("stasis refuses what plain CRIU restores on this machine: {why}"))
        }
        Outcome::Refused(_) => Ok(()),
        Outcome::Failed(why) if plain_restores => {
            Err(format!("stasis fails where plain CRIU restores (a stasis bug): {why}"))
        }
        Outcome::Failed(why) => Err(format!(
            "stasis fails; plain CRIU cannot restore this either ({}), so stasis must refuse it up \
             front, before freezing anything, with the reason; instead: {why}",
            match plain {
                Some(Outcome::Failed(plain)) => plain.as_str(),
                _ => "not tried",
            }
        )),
    }
}

/// The text of a panic's payload.
pub(super) fn panic_text(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic without a message".into())
}

/// The results file of one case and start.
pub(super) struct Report {
    file: File,
    program: &'static str,
    note: &'static str,
}

impl Report {
    /// `target/compat/<case>-<start>.jsonl`, emptied.
    pub(super) fn new(case: &Case, start: &'static str) -> Report {
        let dir = crate::bin_dir()
            .parent()
            .map(|target| target.join("compat"))
            .unwrap_or_else(|| PathBuf::from("compat"));
        std::fs::create_dir_all(&dir).expect("target/compat");
        let path = dir.join(format!("{}-{}.jsonl", case.slug(), start.replace(' ', "-")));
        let file = File::create(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Report { file, program: case.program, note: case.note }
    }

    /// Writes the row of `outcome` in `mode`, the program started and checkpointed as `start`
    /// says (`stasis run`, `by pid`, `plain CRIU`).
    pub(super) fn row(&mut self, start: &str, mode: Mode, outcome: &Outcome) {
        let (result, detail, memory) = match outcome {
            Outcome::Restored { before, after } => {
                ("restored", outcome.beyond_bound(), Some((before, after)))
            }
            Outcome::Refused(why) => ("refused", Some(why.clone()), None),
            Outcome::Failed(why) => ("failed", Some(why.clone()), None),
        };
        let row = json!({
            "program": self.program,
            "note": self.note,
            "start": start,
            "mode": mode.name(),
            "result": result,
            "pss_within_bound": outcome.within_bound(),
            "pss_before_kib": memory.map(|m| m.0.pss),
            "pss_after_kib": memory.map(|m| m.1.pss),
            "held_before_kib": memory.map(|m| m.0.held),
            "held_after_kib": memory.map(|m| m.1.held),
            "detail": detail,
        });
        writeln!(self.file, "{row}").expect("writing a result row");
    }
}
