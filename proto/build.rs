//! Generates Rust code for our own .proto files with a vendored protoc, so that no system
//! protobuf compiler is needed.

/// The `stasis.v1` messages the CLI prints with `--json`. They derive `serde::Serialize`, so
/// the JSON output has the proto field names (snake_case) and nesting, with absent messages
/// as `null` and 64-bit integers as numbers (unlike the proto3 JSON mapping).
const PRINTED: [&str; 17] = [
    "RunResponse",
    "CheckResponse",
    "BrokenCheckpoint",
    "RestoreRunning",
    "CheckpointResult",
    "CheckpointStats",
    "RestoreResult",
    "RestoreStats",
    "CheckpointInfo",
    "ListResponse",
    "WorkloadStatus",
    "StatusResponse",
    "GcResponse",
    "Evacuation",
    "EvacuateResponse",
    "ExportResponse",
    "ImportResponse",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts run this before spawning any thread, so no concurrent reader
    // of the environment exists.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let mut builder = tonic_prost_build::configure().build_server(true).build_client(true);
    for message in PRINTED {
        builder = builder.message_attribute(format!(".stasis.v1.{message}"), "#[derive(serde::Serialize)]");
    }
    // `stasis run --json` prints the log path as `log`.
    builder = builder.field_attribute(".stasis.v1.RunResponse.log_path", r#"#[serde(rename = "log")]"#);
    builder.compile_protos(
        &[
            "proto/stasis/v1/stasis.proto",
            "proto/stasis/store/v1/manifest.proto",
            "proto/criu/rpc.proto",
            "proto/criu/pagemap.proto",
            "proto/criu/refs.proto",
            "proto/cri/runtime.proto",
            "proto/nri/api.proto",
            "proto/nri/ttrpc.proto",
        ],
        &["proto"],
    )?;
    Ok(())
}
