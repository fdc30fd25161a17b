#!/usr/bin/env bash
# Builds kubevol and its loop-device CSI driver and runs kubevol once on the example manifests
# shipped in examples/manifests, inside a private mount namespace on a temporary root
# directory, with the driver registered through the root's plugins_registry. It prints the
# table of what was mounted where, then the namespace's mount table; when it exits, the
# namespace and its mounts are gone, the loop devices detached and the temporary root
# removed. Needs root (unshare, mount, losetup) and e2fsprogs (mkfs.ext4).
#
# `./run-demo.sh --cluster` runs kubevol as the node of a real cluster instead
# (examples/cluster-demo.sh).
#
# `./run-demo.sh --containers` runs real containers on what kubevol mounts: the batch pod of
# examples/batch, its init container then its container, with crun on a static busybox root
# filesystem (examples/batch-node.rs); it prints each container's output, then tears the
# volumes down. Installs crun and busybox-static when missing.
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = --cluster ]; then
  exec examples/cluster-demo.sh
fi
if [ "${1:-}" = --containers ]; then
  missing=()
  command -v crun >/dev/null || missing+=(crun)
  { [ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1; } || missing+=(busybox-static)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]}" >&2
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
  fi
  cargo build --release -p kubevol --example batch-node
  rootfs=$(mktemp -d /tmp/kubevol-rootfs.XXXXXX)
  trap 'rm -rf --one-file-system "$rootfs"' EXIT
  chmod 755 "$rootfs"
  mkdir "$rootfs/bin"
  cp /bin/busybox "$rootfs/bin/"
  for applet in $(/bin/busybox --list); do
    [ -e "$rootfs/bin/$applet" ] || ln -s busybox "$rootfs/bin/$applet"
  done
  RUST_LOG=${RUST_LOG:-warn} "${CARGO_TARGET_DIR:-target}/release/examples/batch-node" examples/batch "$rootfs"
  exit
fi
# cargo prints its progress: a cold build takes minutes on 2 cores.
cargo build --release --bin kubevol --bin kubevol-csi-loop
# Where cargo put the binaries: CARGO_TARGET_DIR when set (absolute, or relative to here).
bin="${CARGO_TARGET_DIR:-target}/release"
root=$(mktemp -d /tmp/kubevol-demo.XXXXXX)
trap 'rm -rf --one-file-system "$root"' EXIT
status=0
RUST_LOG=${RUST_LOG:-warn} unshare --mount --propagation private \
  examples/with-loop-driver.sh "$bin" "$root" sh -c '
  "$2/kubevol" run --once --manifests examples/manifests --root-dir "$1" --node-name demo \
    --csi-controller "$KUBEVOL_CSI_CONTROLLER"
  s=$?
  echo
  echo "Mounts made in the private namespace:"
  findmnt --list --noheadings --output TARGET,FSTYPE,OPTIONS | grep -F "$1" || echo "  (none)"
  exit $s' sh "$root" "$bin" || status=$?
exit "$status"
