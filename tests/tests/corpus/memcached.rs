//! memcached holding 20 MiB of items written through its text protocol, with a client
//! connection kept open, idle, across the checkpoint.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;

use stasis_tests::corpus::{Case, Phase, Program, Tree};
use stasis_tests::{TIMEOUT, expect_within, free_port, installed, noise};

const CASE: Case = Case {
    program: "memcached",
    note: "20 MiB of items; an idle client connection used after the restore",
    set_up: Memcached::set_up,
    known_gaps: &[],
};

/// Items stored, and the size of each.
const ITEMS: u64 = 20_000;
const ITEM_BYTES: usize = 1000;

case_tests!(CASE);

/// A client connection speaking memcached's text protocol.
struct Conn(BufReader<TcpStream>);

impl Conn {
    fn connect(port: u16) -> std::io::Result<Conn> {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(TIMEOUT))?;
        Ok(Conn(BufReader::new(stream)))
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        self.0.read_line(&mut line).expect("a line from memcached");
        line.trim_end().to_owned()
    }

    /// Stores items `keys` (pipelined: all requests, then all answers).
    fn set(&mut self, keys: impl Iterator<Item = u64> + Clone) {
        let mut requests = Vec::new();
        for k in keys.clone() {
            requests.extend(format!("set item:{k} 0 0 {ITEM_BYTES}\r\n").bytes());
            requests.extend(noise(k, ITEM_BYTES));
            requests.extend(b"\r\n");
        }
        self.0.get_mut().write_all(&requests).expect("sending sets to memcached");
        for k in keys {
            assert_eq!(self.line(), "STORED", "memcached's answer to the set of item:{k}");
        }
    }

    /// The values of items `keys` (one multi-get), in order; `None` for a missing one.
    fn get(&mut self, keys: &[u64]) -> Vec<Option<Vec<u8>>> {
        let names: Vec<String> = keys.iter().map(|k| format!("item:{k}")).collect();
        self.0.get_mut().write_all(format!("get {}\r\n", names.join(" ")).as_bytes()).expect("get");
        let mut found = std::collections::HashMap::new();
        loop {
            let line = self.line();
            if line == "END" {
                break;
            }
            let words: Vec<&str> = line.split(' ').collect();
            let ["VALUE", name, _, len] = words[..] else { panic!("memcached answered {line:?}") };
            let mut value = vec![0; len.parse::<usize>().expect("a length") + 2];
            self.0.read_exact(&mut value).expect("a value");
            value.truncate(value.len() - 2);
            found.insert(name.to_owned(), value);
        }
        names.iter().map(|n| found.remove(n)).collect()
    }

    /// `stats` field `name`.
    fn stat(&mut self, name: &str) -> String {
        self.0.get_mut().write_all(b"stats\r\n").expect("stats");
        let mut value = None;
        loop {
            let line = self.line();
            if line == "END" {
                return value.unwrap_or_else(|| panic!("no {name} in memcached's stats"));
            }
            if let Some(v) = line.strip_prefix(&format!("STAT {name} ")) {
                value = Some(v.to_owned());
            }
        }
    }
}

struct Memcached {
    bin: String,
    port: u16,
    /// The connection kept open across checkpoints.
    kept: Option<Conn>,
    /// Items stored since populate (by checks, each a new request), and how many of them the
    /// last checkpoint holds.
    extra: u64,
    at_checkpoint: u64,
}

impl Memcached {
    fn set_up(_dir: &Path) -> Result<Box<dyn Program>, String> {
        let bin = installed("memcached").ok_or("memcached is not installed (Debian's memcached)")?;
        Ok(Box::new(Memcached { bin, port: free_port(), kept: None, extra: 0, at_checkpoint: 0 }))
    }

    fn kept(&mut self) -> &mut Conn {
        let port = self.port;
        self.kept.get_or_insert_with(|| Conn::connect(port).expect("a connection to memcached"))
    }
}

impl Program for Memcached {
    fn argv(&self) -> Vec<String> {
        let port = self.port.to_string();
        [&self.bin, "-u", "root", "-l", "127.0.0.1", "-p", &port, "-U", "0", "-m", "64", "-t", "2"]
            .map(str::to_owned)
            .to_vec()
    }

    fn populate(&mut self, _tree: &Tree) {
        let port = self.port;
        self.kept =
            Some(expect_within(TIMEOUT, "memcached to take connections", || Conn::connect(port).ok()));
        for batch in 0..ITEMS / 1000 {
            self.kept().set(batch * 1000..(batch + 1) * 1000);
        }
    }

    fn check(&mut self, _tree: &Tree, phase: Phase) {
        if phase == Phase::Restored {
            self.extra = self.at_checkpoint;
        }
        let sample: Vec<u64> = (0..200).map(|i| (i * 7919 + 13) % ITEMS).collect();
        let values = self.kept().get(&sample);
        for (k, v) in sample.iter().zip(values) {
            assert!(v.as_deref() == Some(&noise(*k, ITEM_BYTES)[..]), "item:{k} lost its value");
        }
        assert_eq!(self.kept().stat("curr_items"), (ITEMS + self.extra).to_string());
        // A new connection, a new item.
        let fresh = ITEMS + 1000 + self.extra;
        let mut conn = Conn::connect(self.port).expect("a new connection to memcached");
        conn.set(fresh..fresh + 1);
        assert_eq!(conn.get(&[fresh]), [Some(noise(fresh, ITEM_BYTES))]);
        self.extra += 1;
    }

    fn before_checkpoint(&mut self, _tree: &Tree) {
        self.at_checkpoint = self.extra;
    }

    fn disconnect(&mut self) {
        self.kept = None;
    }
}
