//! The HTTP/1.1 plumbing the tests' own servers share (the fault-injecting S3 relay, the cloud
//! metadata emulator): a thread per connection, and reading a message's head and body.

use std::io::BufRead;
use std::net::{TcpListener, TcpStream};

/// Serves every connection `listener` accepts with `handle`, each in a thread of its own, for
/// as long as the test runs; a connection's errors end that connection only.
pub(crate) fn serve_each(
    listener: TcpListener,
    handle: impl Fn(TcpStream) -> std::io::Result<()> + Send + Sync + 'static,
) {
    let handle = std::sync::Arc::new(handle);
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let handle = handle.clone();
            std::thread::spawn(move || {
                let _ = handle(client);
            });
        }
    });
}

/// A message head up to its blank line: its bytes and its lines; `None` at the end of input.
pub(crate) fn read_head(r: &mut impl BufRead) -> std::io::Result<Option<(Vec<u8>, Vec<String>)>> {
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
pub(crate) fn read_body(r: &mut impl BufRead, lines: &[String], no_body: bool) -> std::io::Result<Vec<u8>> {
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

/// A client's HTTP/1.1 connection to a server on loopback, kept open between requests (the
/// idle connection a checkpoint finds and a restore must bring back).
pub struct HttpConn(std::io::BufReader<TcpStream>);

impl HttpConn {
    pub fn connect(port: u16) -> std::io::Result<HttpConn> {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(crate::TIMEOUT))?;
        Ok(HttpConn(std::io::BufReader::new(stream)))
    }

    /// Sends `method path` with `body` and reads the answer: its status code and its body
    /// (as its Content-Length frames it).
    pub fn request(&mut self, method: &str, path: &str, body: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
        use std::io::Write;
        let head =
            format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {}\r\n\r\n", body.len());
        let stream = self.0.get_mut();
        stream.write_all(head.as_bytes())?;
        stream.write_all(body)?;
        let closed = || std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "connection closed");
        let (_, lines) = read_head(&mut self.0)?.ok_or_else(closed)?;
        let code = lines.first().and_then(|l| l.split_whitespace().nth(1)?.parse().ok());
        let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, format!("status line {lines:?}"));
        let code = code.ok_or_else(bad)?;
        Ok((code, read_body(&mut self.0, &lines, method == "HEAD")?))
    }

    /// A `GET path` that must answer 200; its body.
    pub fn get(&mut self, path: &str) -> Vec<u8> {
        match self.request("GET", path, &[]) {
            Ok((200, body)) => body,
            Ok((code, body)) => panic!("GET {path}: {code} {}", String::from_utf8_lossy(&body)),
            Err(e) => panic!("GET {path}: {e}"),
        }
    }
}
