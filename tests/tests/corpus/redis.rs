//! Redis holding 25 MiB, checkpointed while a background save (BGSAVE) child is writing its
//! snapshot: the child comes back with its parent and finishes the save.

use std::path::{Path, PathBuf};

use stasis_tests::corpus::{Case, Mode, Phase, Program, Tree};
use stasis_tests::resp::{self, Client, Reply, status};
use stasis_tests::{TIMEOUT, expect_within, free_port, noise};

const CASE: Case = Case {
    program: "Redis",
    note: "25 MiB; a BGSAVE child in flight at the checkpoint finishes its save after the restore",
    set_up: Redis::set_up,
    known_gaps: &[(
        Mode::LeftRunning,
        "the save child writes its temp file on after the checkpoint; CRIU restores it only at the size it had \
         (plain CRIU: 'File ... has bad size'); not foreseeable when the checkpoint is taken",
    )],
};

/// Keys `DEBUG POPULATE` creates, 1000 bytes each.
const KEYS: u64 = 20_000;
/// Microseconds the save child spends on each key: a save takes 8 s, so the checkpoint finds
/// it at work.
const SAVE_DELAY_US: u64 = 400;

case_tests!(CASE);

struct Redis {
    bin: String,
    dir: PathBuf,
    port: u16,
    kept: Option<Client>,
    /// `DEBUG DIGEST` of the data set once populated.
    digest: Option<Reply>,
}

impl Redis {
    fn set_up(dir: &Path) -> Result<Box<dyn Program>, String> {
        let bin = resp::redis_server().ok_or("redis-server is not installed (Debian's redis-server)")?;
        Ok(Box::new(Redis { bin, dir: dir.to_path_buf(), port: free_port(), kept: None, digest: None }))
    }

    fn kept(&mut self) -> &mut Client {
        let port = self.port;
        self.kept.get_or_insert_with(|| Client::connect(port).expect("a connection to redis"))
    }

    fn saving(&mut self) -> bool {
        self.kept().info("persistence", "rdb_bgsave_in_progress").as_deref() == Some("1")
    }
}

impl Program for Redis {
    fn argv(&self) -> Vec<String> {
        let (port, delay) = (self.port.to_string(), SAVE_DELAY_US.to_string());
        let dir = self.dir.to_string_lossy();
        [&self.bin, "--port", &port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            .into_iter()
            .chain(["--daemonize", "no", "--dir", &dir, "--enable-debug-command", "local"])
            .chain(["--rdb-key-save-delay", &delay])
            // Compressing the 1 MiB value makes the save child take and keep a 1 MiB buffer
            // at a random point of its save (+1.4 MiB over the tree, x1.05 of it): the
            // samples before the checkpoint and after the restore could fall either side.
            .chain(["--rdbcompression", "no"])
            .map(str::to_owned)
            .collect()
    }

    fn populate(&mut self, _tree: &Tree) {
        let port = self.port;
        self.kept = Some(expect_within(TIMEOUT, "redis to answer PING", || {
            let mut c = Client::connect(port).ok()?;
            (c.try_call(&[b"PING"]).ok()? == status("PONG")).then_some(c)
        }));
        assert_eq!(self.kept().cmd(&format!("DEBUG POPULATE {KEYS} key 1000")), status("OK"));
        assert_eq!(self.kept().call(&[b"SET", b"distinct", &noise(1, 1 << 20)]), status("OK"));
        self.digest = Some(self.kept().cmd("DEBUG DIGEST"));
    }

    fn check(&mut self, tree: &Tree, phase: Phase) {
        let digest = self.kept().cmd("DEBUG DIGEST");
        assert_eq!(Some(digest), self.digest, "the data set's digest");
        assert_eq!(self.kept().call(&[b"GET", b"distinct"]), Reply::Bulk(Some(noise(1, 1 << 20))));
        if phase == Phase::Restored {
            assert!(self.saving(), "the background save the checkpoint found goes on after the restore");
            assert_eq!(tree.program_pids().len(), 2, "redis and its save child");
        }
        let mut fresh = Client::connect(self.port).expect("a new connection to redis");
        assert_eq!(fresh.cmd("PING"), status("PONG"));
        assert_eq!(fresh.cmd("EXISTS key:4242"), Reply::Int(1));
    }

    fn before_checkpoint(&mut self, tree: &Tree) {
        if !self.saving() {
            assert_eq!(self.kept().cmd("BGSAVE"), status("Background saving started"));
        }
        tree.wait_processes(2);
    }

    fn disconnect(&mut self) {
        self.kept = None;
    }

    fn settle(&mut self, tree: &Tree) {
        expect_within(TIMEOUT * 2, "the restored background save to finish", || {
            (!self.saving()).then_some(())
        });
        let last = self.kept().info("persistence", "rdb_last_bgsave_status");
        assert_eq!(last.as_deref(), Some("ok"), "the restored background save's result");
        assert!(self.dir.join("dump.rdb").exists(), "the save wrote dump.rdb");
        tree.wait_processes(1);
    }
}
