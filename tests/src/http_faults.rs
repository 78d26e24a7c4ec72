//! An HTTP/1.1 relay in front of a test object store (S3, Azure or GCS emulator) that fails
//! chosen requests: a store that answers 503 (as S3 does when it asks clients to slow down),
//! drops connections, is slow, returns damaged data, or dies, for some requests only (uploads
//! of packs, writes of manifests, reads of packs), so a test can break one phase of a
//! checkpoint or a restore.

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
    /// The store dies: half the request's body reaches the server, then its connection is cut,
    /// and so is every connection at its next request until the rule is lifted.
    Die,
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
    rule: Arc<Rules>,
}

/// The rule in force, and whether a [`Fault::Die`] has struck under it.
type Rules = Mutex<(Option<Rule>, bool)>;

impl FaultyHttp {
    pub fn start(target: u16) -> FaultyHttp {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port for the relay");
        let port = listener.local_addr().expect("relay address").port();
        let rule: Arc<Rules> = Arc::default();
        let rules = rule.clone();
        serve_each(listener, move |client| relay(client, target, &rules));
        FaultyHttp { port, rule }
    }

    /// Fails requests `rule` matches from now on (`None`: none; a dead store is back).
    pub fn set(&self, rule: Option<Rule>) {
        *self.rule.lock().unwrap() = (rule, false);
    }
}

/// Relays requests of one client connection, one at a time.
fn relay(client: TcpStream, target: u16, rules: &Rules) -> std::io::Result<()> {
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
        let fault = {
            let mut rules = rules.lock().unwrap();
            let (rule, dead) = &mut *rules;
            let fault =
                rule.as_ref().filter(|r| r.method == method && path.contains(r.path)).map(|r| r.fault);
            match *dead {
                true => Some(Fault::Reset),
                false => {
                    *dead = fault == Some(Fault::Die);
                    fault
                }
            }
        };
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
            Some(Fault::Die) => {
                to_server.write_all(&head)?;
                to_server.write_all(&body[..body.len() / 2])?;
                let _ = to_server.shutdown(Shutdown::Both);
                return to_client.shutdown(Shutdown::Both);
            }
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
