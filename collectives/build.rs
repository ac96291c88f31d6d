//! Compiles `proto/store.proto` (the rendezvous store) with protox and tonic-build; no protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/store.proto");
    let fds = protox::compile(["store.proto"], ["proto"])?;
    tonic_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
