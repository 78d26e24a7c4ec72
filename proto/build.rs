//! Generates Rust code for our own .proto files with a vendored protoc, so that no system
//! protobuf compiler is needed.

/// The messages the CLI prints with `--json`: `stasis.v1`'s, and the store's checkpoint stats
/// that two of them hold. They derive `serde::Serialize`, so the JSON output has the proto
/// field names (snake_case) and nesting, with absent messages as `null` and 64-bit integers as
/// numbers (unlike the proto3 JSON mapping).
const PRINTED: [&str; 17] = [
    "v1.RunResponse",
    "v1.CheckResponse",
    "v1.BrokenCheckpoint",
    "v1.RestoreRunning",
    "v1.CheckpointResult",
    "store.v1.CheckpointStats",
    "v1.RestoreResult",
    "v1.RestoreStats",
    "v1.CheckpointInfo",
    "v1.ListResponse",
    "v1.WorkloadStatus",
    "v1.StatusResponse",
    "v1.GcResponse",
    "v1.Evacuation",
    "v1.EvacuateResponse",
    "v1.ExportResponse",
    "v1.ImportResponse",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts run this before spawning any thread, so no concurrent reader
    // of the environment exists.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let mut builder = tonic_prost_build::configure().build_server(true).build_client(true);
    for message in PRINTED {
        builder = builder.message_attribute(format!(".stasis.{message}"), "#[derive(serde::Serialize)]");
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
