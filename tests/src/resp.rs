//! A client of redis's protocol (RESP2), for the tests that checkpoint Debian's redis-server.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;

use crate::TIMEOUT;

/// A reply in redis's protocol.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Reply {
    Status(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Vec<Reply>),
}

/// `+text`, a status reply.
pub fn status(text: &str) -> Reply {
    Reply::Status(text.to_owned())
}

/// One client connection to redis.
pub struct Client(BufReader<TcpStream>);

impl Client {
    pub fn connect(port: u16) -> io::Result<Client> {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
        stream.set_read_timeout(Some(TIMEOUT))?;
        Ok(Client(BufReader::new(stream)))
    }

    /// Sends one command and reads its reply.
    pub fn try_call(&mut self, args: &[&[u8]]) -> io::Result<Reply> {
        let mut request = format!("*{}\r\n", args.len()).into_bytes();
        for arg in args {
            request.extend(format!("${}\r\n", arg.len()).bytes());
            request.extend(*arg);
            request.extend(b"\r\n");
        }
        self.0.get_mut().write_all(&request)?;
        self.read_reply()
    }

    /// [`Client::try_call`], panicking on I/O errors and on error replies.
    pub fn call(&mut self, args: &[&[u8]]) -> Reply {
        let what = String::from_utf8_lossy(args[0]);
        match self.try_call(args) {
            Ok(Reply::Error(e)) => panic!("redis refused {what}: {e}"),
            Ok(reply) => reply,
            Err(e) => panic!("redis {what}: {e}"),
        }
    }

    /// A command made of words without spaces, e.g. `DEBUG POPULATE 10 key 1000`.
    pub fn cmd(&mut self, words: &str) -> Reply {
        self.call(&words.split_whitespace().map(str::as_bytes).collect::<Vec<_>>())
    }

    /// The value of `field` in the `INFO section` reply.
    pub fn info(&mut self, section: &str, field: &str) -> Option<String> {
        let Reply::Bulk(Some(text)) = self.cmd(&format!("INFO {section}")) else { return None };
        let text = String::from_utf8_lossy(&text).into_owned();
        text.lines().find_map(|l| l.strip_prefix(field)?.strip_prefix(':')).map(str::to_owned)
    }

    fn read_reply(&mut self) -> io::Result<Reply> {
        let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_owned());
        let mut line = String::new();
        self.0.read_line(&mut line)?;
        let line =
            line.strip_suffix("\r\n").ok_or_else(|| bad("reply line without CRLF (connection closed?)"))?;
        let rest = line.get(1..).unwrap_or_default();
        let number = || rest.parse::<i64>().map_err(|_| bad(&format!("not a number: {line}")));
        Ok(match line.chars().next() {
            Some('+') => Reply::Status(rest.to_owned()),
            Some('-') => Reply::Error(rest.to_owned()),
            Some(':') => Reply::Int(number()?),
            Some('$') => match usize::try_from(number()?) {
                Err(_) => Reply::Bulk(None),
                Ok(len) => {
                    let mut data = vec![0; len + 2];
                    self.0.read_exact(&mut data)?;
                    data.truncate(len);
                    Reply::Bulk(Some(data))
                }
            },
            Some('*') => Reply::Array((0..number()?).map(|_| self.read_reply()).collect::<io::Result<_>>()?),
            _ => return Err(bad(&format!("unknown reply: {line}"))),
        })
    }
}

/// Debian's `/usr/bin/redis-server` (or the first on `PATH`), if installed.
pub fn redis_server() -> Option<String> {
    crate::installed("redis-server")
}
