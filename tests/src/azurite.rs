//! Azure Blob Storage for tests: Azurite's blob service (npm's `azurite`, installed by
//! scripts/test.sh under .stasis/azurite) on a free loopback port, in memory, with a container,
//! and the options that point stasisd at it as at any account: `AZURE_STORAGE_ENDPOINT`, the
//! account's name and key (Azurite's well-known `devstoreaccount1`), `AZURE_ALLOW_HTTP`.

use std::path::PathBuf;
use std::process::Command;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;

use crate::DaemonOptions;
use crate::emulator::{Emulator, daemon_options, present, request};

pub const CONTAINER: &str = "stasis-test";
/// Azurite's well-known account and key (the legacy storage emulator's too).
const ACCOUNT: &str = "devstoreaccount1";
const KEY: &str = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// An Azurite blob service, killed on drop.
pub struct Azurite {
    server: Emulator,
    pub port: u16,
}

impl Azurite {
    /// Starts Azurite with an empty container [`CONTAINER`]; `None` (after saying so on stderr)
    /// where Azurite is not installed.
    pub fn start() -> Option<Azurite> {
        let azurite = std::env::var_os("STASIS_AZURITE").map(PathBuf::from).unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../.stasis/azurite/node_modules/.bin/azurite-blob")
        });
        if !present(&azurite, "Azurite") {
            return None;
        }
        let command = |port: u16| {
            let mut azurite = Command::new(&azurite);
            let port = port.to_string();
            azurite.args(["--blobHost", "127.0.0.1", "--blobPort", &port, "--inMemoryPersistence"]);
            // Without it Azurite sends usage reports to Microsoft.
            azurite.args(["--disableTelemetry", "--silent"]);
            azurite
        };
        let server = Emulator::start("Azurite", command, create_container);
        Some(Azurite { port: server.port, server })
    }

    pub fn pid(&self) -> i32 {
        self.server.pid()
    }

    /// Options for a stasisd storing under `prefix` of the container, reaching Azurite through
    /// `port` (its own, or a proxy's), with extra `args`.
    pub fn daemon_options_at(&self, port: u16, prefix: &str, args: &[&str]) -> DaemonOptions {
        let env = [
            ("AZURE_STORAGE_ACCOUNT_NAME", ACCOUNT.to_string()),
            ("AZURE_STORAGE_ACCOUNT_KEY", KEY.to_string()),
            ("AZURE_STORAGE_ENDPOINT", format!("http://127.0.0.1:{port}/{ACCOUNT}")),
            ("AZURE_ALLOW_HTTP", "true".to_string()),
        ];
        daemon_options(format!("az://{CONTAINER}/{prefix}"), args, &env)
    }
}

/// Creates [`CONTAINER`], signing the request with the account key (Shared Key).
fn create_container(port: u16) -> Result<(), String> {
    let date = jiff::fmt::rfc2822::DateTimePrinter::new()
        .timestamp_to_rfc9110_string(&jiff::Timestamp::now())
        .map_err(|e| e.to_string())?;
    let version = "2021-08-06";
    // The verb, eleven standard headers (all empty here), the x-ms- headers, the resource.
    let signed = format!(
        "PUT\n{}x-ms-date:{date}\nx-ms-version:{version}\n/{ACCOUNT}/{ACCOUNT}/{CONTAINER}\nrestype:container",
        "\n".repeat(11)
    );
    let key = STANDARD.decode(KEY).expect("the well-known key is base64");
    let signature = ring::hmac::sign(&ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key), signed.as_bytes());
    let authorization = format!("SharedKey {ACCOUNT}:{}", STANDARD.encode(signature.as_ref()));
    let headers =
        [("x-ms-date", date.as_str()), ("x-ms-version", version), ("Authorization", &authorization)];
    let answer = request(port, "PUT", &format!("/{ACCOUNT}/{CONTAINER}?restype=container"), &headers, &[])
        .map_err(|e| format!("creating the container: {e}"))?;
    match answer.starts_with("HTTP/1.1 201") {
        true => Ok(()),
        false => Err(format!("creating the container: {answer}")),
    }
}
