//! The webhook's HTTPS server as the API server meets it: TLS with the certificate of its
//! secret (made here with openssl), AdmissionReviews posted to /mutate (with curl, checking
//! the certificate), health on /healthz, and a clear 400 for what is not a review.

use std::net::{SocketAddr, TcpListener};
use std::process::Command;

use serde_json::Value;
use stasis_webhook::mutate::Sizing;
use stasis_webhook::server;

/// A self-signed certificate for `localhost` and its key, in `dir`.
fn certificate(dir: &std::path::Path) -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let made = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"])
        .args(["-addext", "subjectAltName=DNS:localhost"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output();
    match made {
        Ok(out) if out.status.success() => Some((cert, key)),
        _ => None,
    }
}

fn curl(args: &[&str]) -> (String, String) {
    let out = Command::new("curl").args(["-sS", "-w", "\n%{http_code}"]).args(args).output().expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or((&text, ""));
    (body.to_owned(), code.to_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn reviews_are_answered_over_tls() {
    let dir = std::env::temp_dir().join(format!("stasis-webhook-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let Some((cert, key)) = certificate(&dir) else {
        eprintln!("skipping: no openssl to make a certificate");
        return;
    };
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let acceptor = server::tls(&cert, &key).unwrap();
    let sizing = Sizing { store_bytes_per_sec: 200_000_000, gpu_memory_bytes: 80 << 30, margin_secs: 30 };
    tokio::spawn(server::serve(listen, acceptor, sizing));
    let url = |path: &str| format!("https://localhost:{port}{path}");
    let ca = cert.display().to_string();
    let healthy = (0..50).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(50));
        curl(&["--cacert", &ca, &url("/healthz")]).1 == "200"
    });
    assert!(healthy, "the webhook answers on /healthz");

    let review = format!("@{}/tests/reviews/statefulset.json", env!("CARGO_MANIFEST_DIR"));
    let (body, code) = curl(&[
        "--cacert",
        &ca,
        "-H",
        "Content-Type: application/json",
        "--data-binary",
        &review,
        &url("/mutate"),
    ]);
    assert_eq!(code, "200", "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["response"]["allowed"], true);
    assert_eq!(answer["response"]["patchType"], "JSONPatch");

    let (body, code) = curl(&["--cacert", &ca, "--data-binary", "not json", &url("/mutate")]);
    assert_eq!(code, "400");
    assert!(body.contains("not JSON"), "{body}");
    std::fs::remove_dir_all(&dir).unwrap();
}
