//! Compiles the gRPC definitions with protox (a protobuf compiler in Rust), so building needs
//! no protoc on the machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/csi.proto", "proto/pluginregistration.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
