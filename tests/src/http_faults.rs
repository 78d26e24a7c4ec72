//! An HTTP/1.1 relay in front of the S3 test server that fails chosen requests: a store that
//! answers 503 (as S3 does when it asks clients to slow down), drops connections, is slow, or
//! returns damaged data, for some requests only (uploads of packs, writes of manifests, reads of packs), so a test
//! can break one phase of a checkpoint or a restore.

use std::io::{BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::http::{read_body, read_head, serve_each};

/// What happens to a request a rule matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// `503 Slow Down`.
    Unavailable,
    /// The connection is closed without an answer.
    Reset,
    /// Answered, after this long.
    Slow(Duration),
    /// Never answered: the connection stays open until the client gives up.
    Hang,
    /// Answered with every byte of the body flipped (bit rot, a tampered bucket).
    Corrupt,
}

/// Requests whose method is `method` and whose path contains `path` get `fault`.
#[derive(Debug, Clone)]
pub struct Rule {
    pub method: &'static str,
    pub path: &'static str,
    pub fault: Fault,
}

/// The relay; `port` is what clients use instead of the server's.
pub struct FaultyHttp {
    pub port: u16,
    rule: Arc<Mutex<Option<Rule>>>,
}

impl FaultyHttp {
    pub fn start(target: u16) -> FaultyHttp {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port for the relay");
        let port = listener.local_addr().expect("relay address").port();
        let rule: Arc<Mutex<Option<Rule>>> = Arc::default();
        let rules = rule.clone();
        serve_each(listener, move |client| relay(client, target, &rules));
        FaultyHttp { port, rule }
    }

    /// Fails requests `rule` matches from now on (`None`: none).
    pub fn set(&self, rule: Option<Rule>) {
        *self.rule.lock().unwrap() = rule;
    }
}

/// Relays requests of one client connection, one at a time.
fn relay(client: TcpStream, target: u16, rules: &Mutex<Option<Rule>>) -> std::io::Result<()> {
    let mut from_client = BufReader::new(client.try_clone()?);
    let mut to_client = client;
    let upstream = TcpStream::connect(("127.0.0.1", target))?;
    let mut from_server = BufReader::new(upstream.try_clone()?);
    let mut to_server = upstream;
    loop {
        let Some((head, lines)) = read_head(&mut from_client)? else { return Ok(()) };
        let mut parts = lines[0].split_whitespace();
        let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        let body = read_body(&mut from_client, &lines, false)?;
        let rule = rules.lock().unwrap().clone().filter(|r| r.method == method && path.contains(r.path));
        let fault = rule.map(|r| r.fault);
        match fault {
            Some(Fault::Unavailable) => {
                let answer = "HTTP/1.1 503 Slow Down\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
                to_client.write_all(answer.as_bytes())?;
                return to_client.shutdown(Shutdown::Both);
            }
            Some(Fault::Reset) => return to_client.shutdown(Shutdown::Both),
            Some(Fault::Hang) => {
                // Until the client closes its end.
                let _ = std::io::copy(&mut from_client, &mut std::io::sink());
                return Ok(());
            }
            Some(Fault::Slow(delay)) => std::thread::sleep(delay),
            Some(Fault::Corrupt) | None => {}
        }
        to_server.write_all(&head)?;
        to_server.write_all(&body)?;
        let Some((head, lines)) = read_head(&mut from_server)? else { return Ok(()) };
        let mut body = read_body(&mut from_server, &lines, method == "HEAD")?;
        if fault == Some(Fault::Corrupt) {
            body.iter_mut().for_each(|b| *b ^= 0x5a);
        }
        to_client.write_all(&head)?;
        to_client.write_all(&body)?;
    }
}
