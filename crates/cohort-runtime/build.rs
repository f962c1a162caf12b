//! Generates the gRPC code from `proto/cohort.proto`. protoc comes from the
//! `protoc-bin-vendored` crate, so building needs no system protobuf compiler.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/cohort.proto");
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        // SAFETY: build scripts are single-threaded; nothing else reads the
        // environment concurrently.
        unsafe { std::env::set_var("PROTOC", protoc) };
    }
    // A chunk's bytes as `bytes::Bytes`: the server sends every client slices
    // of one shared global model, and a received chunk is a slice of the
    // buffer it was decoded from (grpc/wire.rs). The wire is the same.
    tonic_prost_build::configure()
        .bytes(".cohort.v1.Chunk.data")
        .compile_protos(&["proto/cohort.proto"], &["proto"])?;
    Ok(())
}
