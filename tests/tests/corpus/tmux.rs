//! tmux with a shell running a command: the shell (in a pane of the tmux server) runs a loop
//! that answers each line typed into the pane with a counter and a value it set before the
//! checkpoint; the pane's history holds 50,000 lines printed before it.

use std::path::{Path, PathBuf};
use std::process::Command;

use stasis_tests::corpus::{Case, Phase, Program, Tree};
use stasis_tests::{TIMEOUT, expect_within, installed};

/// CRIU gives up on tmux's terminals mid-dump ("ctty inheritance detected": the shell holds
/// /dev/tty, and the server holds its terminal's master), plain CRIU too: stasis refuses it
/// before freezing the tree, with that reason.
const CASE: Case = Case {
    program: "tmux",
    note: "a shell in a pane running a loop that answers typed lines; 50,000 lines of history",
    set_up: Tmux::set_up,
    known_gaps: &[],
};

const HISTORY: u64 = 50_000;
const MARKER: &str = "corpus-marker-31337";

case_tests!(CASE);

struct Tmux {
    bin: String,
    socket: PathBuf,
    /// Lines typed into the loop, and how many of them the last checkpoint had seen.
    typed: u64,
    at_checkpoint: u64,
}

impl Tmux {
    fn set_up(dir: &Path) -> Result<Box<dyn Program>, String> {
        let bin = installed("tmux").ok_or("tmux is not installed (Debian's tmux)")?;
        Ok(Box::new(Tmux { bin, socket: dir.join("tmux.sock"), typed: 0, at_checkpoint: 0 }))
    }

    /// Runs a tmux client command against the server; its output, or its error.
    fn tmux(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new(&self.bin).arg("-S").arg(&self.socket).args(args).output().expect("tmux");
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        if out.status.success() { Ok(text(&out.stdout)) } else { Err(text(&out.stderr)) }
    }

    /// The pane's whole history and screen.
    fn pane(&self) -> String {
        self.tmux(&["capture-pane", "-p", "-J", "-S", "-", "-t", "corpus"]).expect("capture-pane")
    }

    /// Types `line` into the pane and waits until the loop answers it.
    fn type_line(&mut self, line: &str) {
        self.tmux(&["send-keys", "-t", "corpus", line, "Enter"]).expect("send-keys");
        self.typed += 1;
        let answer = format!("got {} {MARKER} {line}", self.typed);
        expect_within(TIMEOUT, &format!("`{answer}` in the pane"), || {
            self.pane().lines().any(|l| l == answer).then_some(())
        });
    }
}

impl Program for Tmux {
    fn argv(&self) -> Vec<String> {
        let socket = self.socket.to_string_lossy().into_owned();
        vec![self.bin.clone(), "-S".into(), socket, "-f".into(), "/dev/null".into(), "-D".into()]
    }

    fn populate(&mut self, _tree: &Tree) {
        expect_within(TIMEOUT, "the tmux server to listen", || {
            self.tmux(&["set-option", "-g", "history-limit", "100000"]).ok()
        });
        self.tmux(&["new-session", "-d", "-s", "corpus", "-x", "120", "-y", "40", "/bin/sh"])
            .expect("new-session");
        let fill = format!("seq -f 'history line %g of the corpus' {HISTORY}");
        self.tmux(&["send-keys", "-t", "corpus", &fill, "Enter"]).expect("send-keys");
        let last = format!("history line {HISTORY} of the corpus");
        expect_within(TIMEOUT * 2, "the history to fill", || {
            self.pane().lines().any(|l| l == last).then_some(())
        });
        let command =
            format!("X={MARKER}; n=0; while read line; do n=$((n+1)); echo \"got $n $X $line\"; done");
        self.tmux(&["send-keys", "-t", "corpus", &command, "Enter"]).expect("send-keys");
        self.type_line("first");
    }

    fn check(&mut self, tree: &Tree, phase: Phase) {
        if phase == Phase::Restored {
            self.typed = self.at_checkpoint;
        }
        assert_eq!(tree.program_pids().len(), 2, "the tmux server and the shell in its pane");
        let pane = self.pane();
        // (The first line may share the screen row of the command typed before the prompt.)
        for n in [2, HISTORY / 2, HISTORY] {
            let line = format!("history line {n} of the corpus");
            assert!(pane.lines().any(|l| l == line), "`{line}` in the pane's history");
        }
        self.type_line(&format!("line-{}", self.typed + 1));
    }

    fn before_checkpoint(&mut self, _tree: &Tree) {
        self.at_checkpoint = self.typed;
    }
}
