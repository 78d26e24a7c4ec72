//! Generates Rust code for our own .proto files with a vendored protoc, so that no system
//! protobuf compiler is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts run this before spawning any thread, so no concurrent reader
    // of the environment exists.
    unsafe { std::env::set_var("PROTOC", protoc) };
    tonic_prost_build::configure().build_server(true).build_client(true).compile_protos(
        &[
            "proto/stasis/v1/stasis.proto",
            "proto/stasis/v1/manifest.proto",
            "proto/criu/rpc.proto",
            "proto/criu/pagemap.proto",
        ],
        &["proto"],
    )?;
    Ok(())
}
