//! A Node.js HTTP server (tests/workloads/node_kv.js) holding 24 MiB of values PUT by its
//! client, with a keep-alive connection kept open, idle, across the checkpoint.

use std::path::Path;

use stasis_tests::corpus::{Case, Phase, Program, Tree};
use stasis_tests::{HttpConn, free_port, installed, noise, workload_script};

const CASE: Case = Case {
    program: "Node.js HTTP server",
    note: "24 MiB of values PUT over HTTP; an idle keep-alive connection used after the restore",
    set_up: Node::set_up,
    known_gaps: &[],
};

/// Values stored, and the size of each.
const VALUES: u64 = 96;
const VALUE_BYTES: usize = 256 << 10;

case_tests!(CASE);

struct Node {
    bin: String,
    port: u16,
    kept: Option<HttpConn>,
    /// Values stored by checks since populate, and how many of them the last checkpoint holds.
    extra: u64,
    at_checkpoint: u64,
}

impl Node {
    fn set_up(_dir: &Path) -> Result<Box<dyn Program>, String> {
        let bin = installed("node").ok_or("node is not installed (Debian's nodejs)")?;
        Ok(Box::new(Node { bin, port: free_port(), kept: None, extra: 0, at_checkpoint: 0 }))
    }

    fn kept(&mut self) -> &mut HttpConn {
        let port = self.port;
        self.kept.get_or_insert_with(|| HttpConn::connect(port).expect("a connection to node"))
    }
}

/// Stores value `k` over `conn`.
fn put(conn: &mut HttpConn, k: u64) {
    let answer = conn.request("PUT", &format!("/kv/{k}"), &noise(k, VALUE_BYTES));
    assert_eq!(answer.map(|(code, _)| code).map_err(|e| e.to_string()), Ok(204), "PUT /kv/{k}");
}

impl Program for Node {
    fn argv(&self) -> Vec<String> {
        vec![self.bin.clone(), workload_script("node_kv.js"), self.port.to_string()]
    }

    fn populate(&mut self, tree: &Tree) {
        stasis_tests::expect_within(stasis_tests::TIMEOUT, "node's `ready`", || {
            stasis_tests::complete_lines(&tree.log).iter().any(|l| l == "ready").then_some(())
        });
        for k in 0..VALUES {
            put(self.kept(), k);
        }
    }

    fn check(&mut self, _tree: &Tree, phase: Phase) {
        if phase == Phase::Restored {
            self.extra = self.at_checkpoint;
        }
        for k in (0..VALUES).step_by(11) {
            assert!(self.kept().get(&format!("/kv/{k}")) == noise(k, VALUE_BYTES), "value {k}");
        }
        let count = String::from_utf8_lossy(&self.kept().get("/count")).into_owned();
        assert_eq!(count, (VALUES + self.extra).to_string(), "the number of values");
        let fresh = VALUES + 1000 + self.extra;
        let mut conn = HttpConn::connect(self.port).expect("a new connection to node");
        put(&mut conn, fresh);
        assert!(conn.get(&format!("/kv/{fresh}")) == noise(fresh, VALUE_BYTES), "the value just stored");
        self.extra += 1;
    }

    fn before_checkpoint(&mut self, _tree: &Tree) {
        self.at_checkpoint = self.extra;
    }

    fn disconnect(&mut self) {
        self.kept = None;
    }
}
