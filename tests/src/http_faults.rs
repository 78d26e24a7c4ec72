//! An HTTP/1.1 relay in front of the S3 test server that fails chosen requests: a store that
//! answers 503 (as S3 does when it asks clients to slow down), drops connections, or is slow,
//! for some requests only (uploads of packs, writes of manifests, reads of packs), so a test
//! can break one phase of a checkpoint or a restore.

use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let rules = rules.clone();
                std::thread::spawn(move || {
                    let _ = relay(client, target, &rules);
                });
            }
        });
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
        match rule.map(|r| r.fault) {
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
            None => {}
        }
        to_server.write_all(&head)?;
        to_server.write_all(&body)?;
        let Some((head, lines)) = read_head(&mut from_server)? else { return Ok(()) };
        let body = read_body(&mut from_server, &lines, method == "HEAD")?;
        to_client.write_all(&head)?;
        to_client.write_all(&body)?;
    }
}

/// A message head up to its blank line: its bytes and its lines; `None` at the end of input.
fn read_head(r: &mut impl BufRead) -> std::io::Result<Option<(Vec<u8>, Vec<String>)>> {
    let (mut head, mut lines) = (Vec::new(), Vec::new());
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Ok(None);
        }
        head.extend_from_slice(line.as_bytes());
        let trimmed = line.trim_end().to_string();
        if trimmed.is_empty() {
            return Ok(Some((head, lines)));
        }
        lines.push(trimmed);
    }
}

/// A message body as the head announces it (Content-Length, or chunked, with its framing).
fn read_body(r: &mut impl BufRead, lines: &[String], no_body: bool) -> std::io::Result<Vec<u8>> {
    let header = |name: &str| {
        lines.iter().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    };
    let mut body = Vec::new();
    if no_body {
        return Ok(body);
    }
    if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut size_line = String::new();
            r.read_line(&mut size_line)?;
            body.extend_from_slice(size_line.as_bytes());
            let size =
                usize::from_str_radix(size_line.trim().split(';').next().unwrap_or("0"), 16).unwrap_or(0);
            let mut chunk = vec![0; size + 2];
            r.read_exact(&mut chunk)?;
            body.extend_from_slice(&chunk);
            if size == 0 {
                return Ok(body);
            }
        }
    }
    let len: usize = header("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
    body.resize(len, 0);
    r.read_exact(&mut body)?;
    Ok(body)
}
