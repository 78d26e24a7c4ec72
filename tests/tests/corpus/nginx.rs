//! nginx, a master and two workers serving a 4 MiB file, with a keep-alive client connection
//! kept open, idle, across the checkpoint.

use std::path::{Path, PathBuf};

use stasis_tests::corpus::{Case, Phase, Program, Tree};
use stasis_tests::{HttpConn, TIMEOUT, expect_within, free_port, installed, noise};

const CASE: Case = Case {
    program: "nginx",
    note: "master and two workers serving a 4 MiB file; an idle keep-alive connection used after the restore",
    set_up: Nginx::set_up,
    known_gaps: &[],
};

const FILE_BYTES: usize = 4 << 20;

case_tests!(CASE);

struct Nginx {
    bin: String,
    dir: PathBuf,
    port: u16,
    kept: Option<HttpConn>,
}

impl Nginx {
    fn set_up(dir: &Path) -> Result<Box<dyn Program>, String> {
        let bin = installed("nginx").ok_or("nginx is not installed (Debian's nginx-light)")?;
        let port = free_port();
        std::fs::create_dir_all(dir.join("www")).expect("nginx's root");
        std::fs::write(dir.join("www/data"), noise(7, FILE_BYTES)).expect("the served file");
        let d = dir.display();
        let conf = format!(
            "daemon off; master_process on; worker_processes 2; user root;\n\
             pid {d}/nginx.pid; error_log {d}/error.log;\n\
             events {{ worker_connections 64; }}\n\
             http {{ access_log off; keepalive_timeout 600s; keepalive_requests 100000;\n\
             client_body_temp_path {d}/body; proxy_temp_path {d}/proxy;\n\
             server {{ listen 127.0.0.1:{port}; root {d}/www; }} }}\n"
        );
        std::fs::write(dir.join("nginx.conf"), conf).expect("nginx.conf");
        Ok(Box::new(Nginx { bin, dir: dir.to_path_buf(), port, kept: None }))
    }

    fn kept(&mut self) -> &mut HttpConn {
        let port = self.port;
        self.kept.get_or_insert_with(|| HttpConn::connect(port).expect("a connection to nginx"))
    }
}

impl Program for Nginx {
    fn argv(&self) -> Vec<String> {
        let path = |name: &str| self.dir.join(name).to_string_lossy().into_owned();
        vec![
            self.bin.clone(),
            "-p".into(),
            path(""),
            "-c".into(),
            path("nginx.conf"),
            "-e".into(),
            path("error.log"),
        ]
    }

    fn populate(&mut self, tree: &Tree) {
        tree.wait_processes(3);
        let port = self.port;
        self.kept =
            Some(expect_within(TIMEOUT, "nginx to take connections", || HttpConn::connect(port).ok()));
    }

    fn check(&mut self, tree: &Tree, _phase: Phase) {
        assert_eq!(tree.program_pids().len(), 3, "nginx's master and two workers");
        let file = noise(7, FILE_BYTES);
        assert!(self.kept().get("/data") == file, "the file over the connection kept open");
        let mut fresh = HttpConn::connect(self.port).expect("a new connection to nginx");
        assert!(fresh.get("/data") == file, "the file over a new connection");
    }

    fn disconnect(&mut self) {
        self.kept = None;
    }
}
