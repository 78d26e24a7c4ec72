//! A SQLite writer (Python's sqlite3, tests/workloads/sqlite_writer.py) holding the database's
//! write lock over a transaction of 20 MiB of rows that exist only in its memory; the sqlite3
//! program is the client.

use std::path::{Path, PathBuf};
use std::process::Command;

use nix::sys::signal::Signal;
use stasis_tests::corpus::{Case, Phase, Program, Tree};
use stasis_tests::{TIMEOUT, complete_lines, expect_within, installed, numbered, procfs, python_workload};

const CASE: Case = Case {
    program: "SQLite writer",
    note: "holds the write lock over 20 MiB of uncommitted rows, committed after the restore",
    set_up: Sqlite::set_up,
    known_gaps: &[],
};

const ROWS: u64 = 20_000;

case_tests!(CASE);

struct Sqlite {
    cli: String,
    db: PathBuf,
}

impl Sqlite {
    fn set_up(dir: &Path) -> Result<Box<dyn Program>, String> {
        let cli = installed("sqlite3").ok_or("sqlite3 is not installed (Debian's sqlite3)")?;
        Ok(Box::new(Sqlite { cli, db: dir.join("corpus.db") }))
    }

    /// Runs `sql` with the sqlite3 program: its output, or its error.
    fn sql(&self, sql: &str) -> Result<String, String> {
        let out = Command::new(&self.cli).arg(&self.db).arg(sql).output().expect("running sqlite3");
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        if out.status.success() { Ok(text(&out.stdout)) } else { Err(text(&out.stderr)) }
    }

    /// Checks that every committed row holds its value; their number.
    fn committed_rows(&self) -> u64 {
        let rows = self.sql("SELECT id, v FROM t ORDER BY id").expect("reading the committed rows");
        let mut n = 0;
        for (i, line) in rows.lines().enumerate() {
            assert_eq!(line, format!("{i}|{}", format!("{i:08}").repeat(128)), "row {i}");
            n += 1;
        }
        n
    }

    fn assert_locked(&self) {
        let write = self.sql("BEGIN IMMEDIATE; ROLLBACK;");
        assert!(
            write.as_ref().is_err_and(|e| e.contains("database is locked")),
            "another writer must find the database locked by the writer: {write:?}"
        );
    }
}

/// The last `<prefix>N` of the writer's log.
fn last(tree: &Tree, prefix: &str) -> Option<u64> {
    numbered(&complete_lines(&tree.log), prefix).last().copied()
}

impl Program for Sqlite {
    fn argv(&self) -> Vec<String> {
        python_workload("sqlite_writer.py", &[&self.db.to_string_lossy(), &ROWS.to_string()])
    }

    fn populate(&mut self, tree: &Tree) {
        expect_within(TIMEOUT, "the writer's `holding N`", || last(tree, "holding ").filter(|&n| n == ROWS));
    }

    fn check(&mut self, tree: &Tree, phase: Phase) {
        self.assert_locked();
        assert_eq!(self.committed_rows(), 0, "nothing is committed before the writer commits");
        if phase != Phase::Restored {
            return;
        }
        // The rows written before the checkpoint, in the writer's memory only, are committed.
        procfs::signal(tree.main_pid(), Signal::SIGUSR1);
        expect_within(TIMEOUT, "the writer's `committed N`", || {
            last(tree, "committed ").filter(|&n| n == ROWS)
        });
        assert_eq!(self.committed_rows(), ROWS, "the rows the writer held at the checkpoint");
        expect_within(TIMEOUT, "the writer's next transaction", || {
            last(tree, "holding ").filter(|&n| n > ROWS)
        });
        self.assert_locked();
    }
}
