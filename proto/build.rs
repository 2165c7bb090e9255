//! Generates the tonic/prost code with a vendored protoc, so a fresh machine needs no system package.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts run single-threaded before any other code reads the environment.
    unsafe { std::env::set_var("PROTOC", protoc) };
    tonic_prost_build::configure()
        .compile_protos(&["proto/kvmm/v1/session.proto", "proto/kvmm/v1/admin.proto"], &["proto"])?;
    Ok(())
}
