# Sourced by the *_here.sh scripts from the repository root: `stage_launcher DEST EXAMPLE...`
# empties DEST, builds oflaunch and the root package's examples EXAMPLE... in release mode and
# copies them into DEST/bin.
stage_launcher() {
  local dest=$1; shift
  rm -rf "$dest" && mkdir -p "$dest/bin"
  cargo build --release -p oxiflow-launcher --bin oflaunch
  cargo build --release -p oxiflow $(printf -- "--example %s " "$@")
  cp target/release/oflaunch "${@/#/target/release/examples/}" "$dest/bin/"
}
