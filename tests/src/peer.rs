//! A TCP peer outside the checkpointed tree: it accepts one connection on loopback and echoes
//! every line, recording what it got and how the connection ended.

use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

#[derive(Debug, Default)]
struct Seen {
    lines: Vec<String>,
    /// How the connection ended, once it did ("end of stream", or the error).
    ended: Option<String>,
}

/// An echo peer; dropping it closes its connection and listener.
pub struct EchoPeer {
    port: u16,
    seen: Arc<Mutex<Seen>>,
    stream: Arc<Mutex<Option<TcpStream>>>,
    thread: Option<JoinHandle<()>>,
}

impl EchoPeer {
    /// Listens on a free loopback port; the connection is served once a client comes.
    pub fn start() -> EchoPeer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("peer listener");
        let port = listener.local_addr().expect("peer address").port();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stream = Arc::new(Mutex::new(None));
        let thread = {
            let (seen, stream) = (seen.clone(), stream.clone());
            std::thread::spawn(move || serve(listener, &seen, &stream))
        };
        EchoPeer { port, seen, stream, thread: Some(thread) }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The lines received so far.
    pub fn lines(&self) -> Vec<String> {
        self.seen.lock().expect("peer state").lines.clone()
    }

    /// The numbers received so far (lines that are a number).
    pub fn numbers(&self) -> Vec<u64> {
        self.lines().iter().filter_map(|l| l.trim().parse().ok()).collect()
    }

    /// How the connection ended, if it did.
    pub fn ended(&self) -> Option<String> {
        self.seen.lock().expect("peer state").ended.clone()
    }

    /// Closes the connection from this side and waits for the serving thread.
    pub fn disconnect(&mut self) {
        if let Some(s) = self.stream.lock().expect("peer stream").take() {
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for EchoPeer {
    fn drop(&mut self) {
        self.disconnect();
    }
}

fn serve(listener: TcpListener, seen: &Mutex<Seen>, keep: &Mutex<Option<TcpStream>>) {
    let Ok((conn, _)) = listener.accept() else { return };
    drop(listener);
    let Ok(clone) = conn.try_clone() else { return };
    *keep.lock().expect("peer stream") = Some(clone);
    let mut writer = match conn.try_clone() {
        Ok(w) => w,
        Err(_) => return,
    };
    let mut reader = BufReader::new(conn);
    loop {
        let mut line = String::new();
        let ended = match reader.read_line(&mut line) {
            Ok(0) => Some("end of stream".to_string()),
            Ok(_) => writer.write_all(line.as_bytes()).err().map(|e| e.to_string()),
            Err(e) => Some(e.to_string()),
        };
        let mut seen = seen.lock().expect("peer state");
        if let Some(why) = ended {
            seen.ended = Some(why);
            return;
        }
        seen.lines.push(line.trim_end().to_string());
    }
}
