//! PostgreSQL: the postmaster and its backends, 64 MiB of shared buffers holding a 25 MiB
//! table written before the checkpoint and read after it, and an idle client connection
//! (psql, with a session setting and a prepared statement) that is used after the restore.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{MetadataExt, chown};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use stasis_tests::corpus::{Case, Phase, Program, Tree};
use stasis_tests::{TIMEOUT, expect_within, free_port};
use tempfile::TempDir;

const CASE: Case = Case {
    program: "PostgreSQL",
    note: "postmaster and backends, 25 MiB table in shared buffers; an idle psql session used after the restore",
    set_up: Postgres::set_up,
    known_gaps: &[],
};

const ROWS: u64 = 100_000;

case_tests!(CASE);

/// The directory of Debian's PostgreSQL programs (`/usr/lib/postgresql/<version>/bin`), the
/// newest version's.
fn bin_dir() -> Option<PathBuf> {
    let versions = std::fs::read_dir("/usr/lib/postgresql").ok()?;
    let mut dirs: Vec<PathBuf> =
        versions.flatten().map(|v| v.path().join("bin")).filter(|b| b.join("postgres").exists()).collect();
    dirs.sort_by_key(|d| d.parent().and_then(|v| v.file_name()?.to_str()?.parse::<u32>().ok()));
    dirs.pop()
}

/// A psql session kept open: statements in, their rows out.
struct Session {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
}

impl Session {
    fn open(port: u16) -> Session {
        let mut child = Command::new("psql")
            .args(["-X", "-q", "-A", "-t", "-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting psql");
        let input = child.stdin.take().expect("psql's stdin");
        let output = BufReader::new(child.stdout.take().expect("psql's stdout"));
        Session { child, input, output }
    }

    /// Runs `sql`; the rows it printed.
    fn query(&mut self, sql: &str) -> Vec<String> {
        writeln!(self.input, "{sql}\n\\echo __done__").expect("writing to psql");
        let mut rows = Vec::new();
        loop {
            let mut line = String::new();
            assert!(self.output.read_line(&mut line).expect("reading psql") > 0, "psql ended after {rows:?}");
            match line.trim_end() {
                "__done__" => return rows,
                row => rows.push(row.to_owned()),
            }
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Postgres {
    bin: PathBuf,
    /// The data directory's parent, owned by the postgres user (a test's directory is not
    /// open to it).
    home: TempDir,
    port: u16,
    /// The session kept open, its backend's pid, and the table's checksum once populated.
    kept: Option<Session>,
    backend: String,
    table: Vec<String>,
    written: u64,
    /// Its dynamic shared memory segments (POSIX shared memory, in /dev/shm) seen mapped, with
    /// their inodes: a server killed, as every case's ends, leaves them behind.
    segments: BTreeSet<(PathBuf, u64)>,
}

/// The user the server runs as (it refuses root).
const USER: &str = "postgres";

impl Postgres {
    fn set_up(_dir: &Path) -> Result<Box<dyn Program>, String> {
        let bin = bin_dir().ok_or("PostgreSQL is not installed (Debian's postgresql)")?;
        let home = tempfile::Builder::new().prefix("stasis-corpus-pg-").tempdir().expect("a directory");
        let user = nix::unistd::User::from_name(USER).ok().flatten().ok_or("no postgres user")?;
        chown(home.path(), Some(user.uid.as_raw()), Some(user.gid.as_raw())).expect("chown");
        let data = home.path().join("data").to_string_lossy().into_owned();
        let initdb = Command::new("setpriv")
            .args(["--reuid", USER, "--regid", USER, "--init-groups", "--"])
            .arg(bin.join("initdb"))
            .args(["-D", &data, "-U", "postgres", "-A", "trust", "--no-sync", "--no-instructions"])
            .output()
            .expect("running initdb");
        assert!(initdb.status.success(), "initdb: {}", String::from_utf8_lossy(&initdb.stderr));
        let port = free_port();
        Ok(Box::new(Postgres {
            bin,
            home,
            port,
            kept: None,
            backend: String::new(),
            table: Vec::new(),
            written: 0,
            segments: BTreeSet::new(),
        }))
    }

    /// Runs `sql` on a new connection; its rows.
    fn once(&self, sql: &str) -> Vec<String> {
        let mut session = Session::open(self.port);
        session.query(sql)
    }

    /// Notes the /dev/shm segments the tree's processes have mapped.
    fn note_segments(&mut self, tree: &Tree) {
        for pid in tree.pids() {
            let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
            for fields in maps.lines().map(|l| l.split_whitespace().collect::<Vec<_>>()) {
                if let [.., inode, path] = fields[..]
                    && path.starts_with("/dev/shm/PostgreSQL.")
                    && let Ok(inode) = inode.parse()
                {
                    self.segments.insert((PathBuf::from(path), inode));
                }
            }
        }
    }

    /// Opens the session kept open, with a setting and a prepared statement of its own.
    fn open_kept(&mut self) {
        let mut session = Session::open(self.port);
        session.query("SELECT set_config('corpus.marker', 'kept-session', false);");
        session.query("PREPARE probe(int) AS SELECT v FROM t WHERE id = $1;");
        self.backend = session.query("SELECT pg_backend_pid();").concat();
        self.kept = Some(session);
    }
}

const CHECKSUM: &str = "SELECT count(*), md5(string_agg(v, ',' ORDER BY id)) FROM t;";

impl Program for Postgres {
    fn argv(&self) -> Vec<String> {
        let data = self.home.path().join("data").to_string_lossy().into_owned();
        let socket_dir = self.home.path().to_string_lossy().into_owned();
        let mut argv: Vec<String> =
            ["setpriv", "--reuid", USER, "--regid", USER, "--init-groups", "--"].map(str::to_owned).to_vec();
        argv.push(self.bin.join("postgres").to_string_lossy().into_owned());
        argv.extend(
            ["-D", &data, "-k", &socket_dir, "-h", "127.0.0.1", "-p", &self.port.to_string()]
                .map(str::to_owned),
        );
        for setting in ["shared_buffers=64MB", "max_connections=20", "autovacuum=off", "fsync=off"] {
            argv.extend(["-c".to_owned(), setting.to_owned()]);
        }
        argv
    }

    fn populate(&mut self, tree: &Tree) {
        let port = self.port;
        let ready = || {
            let out =
                Command::new("pg_isready").args(["-q", "-h", "127.0.0.1", "-p", &port.to_string()]).status();
            out.is_ok_and(|s| s.success()).then_some(())
        };
        expect_within(TIMEOUT, "PostgreSQL to take connections", ready);
        self.note_segments(tree);
        let create = format!(
            "CREATE TABLE t (id int PRIMARY KEY, v text); \
             INSERT INTO t SELECT g, md5(g::text) || repeat('x', 200) FROM generate_series(1, {ROWS}) g;"
        );
        self.once(&create);
        self.table = self.once(CHECKSUM);
        self.open_kept();
    }

    fn check(&mut self, tree: &Tree, phase: Phase) {
        if self.kept.is_none() {
            self.open_kept();
        }
        self.note_segments(tree);
        let backend = self.backend.clone();
        let session = self.kept.as_mut().expect("the kept session");
        let same =
            session.query(&format!("SELECT current_setting('corpus.marker'), pg_backend_pid() = {backend};"));
        assert_eq!(same, ["kept-session|t"], "the idle session kept open, with its setting, on its backend");
        let probe = session.query("EXECUTE probe(4242);");
        let row = session.query("SELECT md5('4242') || repeat('x', 200);");
        assert_eq!(probe, row, "a row through the session's prepared statement");
        assert_eq!(self.once(CHECKSUM), self.table, "the table written before the checkpoint");
        if phase == Phase::Restored {
            self.written += 1;
            let n = self.written;
            let rows =
                self.once(&format!("CREATE TABLE after_{n} AS SELECT 42 AS x; SELECT x FROM after_{n};"));
            assert_eq!(rows, ["42"], "a write after the restore");
        }
    }

    fn disconnect(&mut self) {
        self.kept = None;
    }
}

impl Drop for Postgres {
    /// Runs once the case is over and its tree killed (a restore needs the segments until
    /// then). A name another instance has taken since is another inode: left alone.
    fn drop(&mut self) {
        for (segment, inode) in &self.segments {
            if std::fs::metadata(segment).is_ok_and(|m| m.ino() == *inode) {
                let _ = std::fs::remove_file(segment);
            }
        }
    }
}
