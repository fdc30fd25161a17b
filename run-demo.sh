#!/usr/bin/env bash
# Builds kubevol and runs it once on the example manifests shipped in examples/manifests,
# inside a private mount namespace on a temporary root directory. It prints the table of what
# was mounted where, then the namespace's mount table; when it exits, the namespace and its
# mounts are gone and the temporary root is removed. Needs root (unshare, mount).
set -euo pipefail
cd "$(dirname "$0")"
cargo build --release --quiet --bin kubevol
root=$(mktemp -d /tmp/kubevol-demo.XXXXXX)
trap 'rm -rf --one-file-system "$root"' EXIT
status=0
RUST_LOG=${RUST_LOG:-warn} unshare --mount --propagation private sh -c '
  target/release/kubevol run --once --manifests examples/manifests --root-dir "$1" --node-name demo
  s=$?
  echo
  echo "Mounts made in the private namespace:"
  findmnt --list --noheadings --output TARGET,FSTYPE,OPTIONS | grep -F "$1" || echo "  (none)"
  exit $s' sh "$root" || status=$?
exit "$status"
