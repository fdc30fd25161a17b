#!/usr/bin/env bash
# The test command: installs what a fresh Debian machine with Rust and Go lacks, builds and
# starts a real control plane (tools/k8s: kube-apiserver, kube-controller-manager and etcd of
# the pinned Kubernetes release, on loopback), runs every test of the workspace — the cluster
# tests against both the in-process API server and the real one — and stops the control plane
# again, also when a test fails. Runs as root (the tests mount inside private mount
# namespaces). Extra arguments go to `cargo test` (e.g. `./test.sh -p kubevol --test cluster`).
set -euo pipefail
cd "$(dirname "$0")"
missing=()
command -v unshare >/dev/null || missing+=(util-linux)
command -v mount >/dev/null || missing+=(mount)
command -v findmnt >/dev/null || missing+=(util-linux)
command -v losetup >/dev/null || missing+=(mount)
command -v mkfs.ext4 >/dev/null || missing+=(e2fsprogs)
command -v mkfs.xfs >/dev/null || missing+=(xfsprogs)
# The container tests run real containers: an OCI runtime, on a static busybox root.
command -v crun >/dev/null || missing+=(crun)
{ [ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1; } || missing+=(busybox-static)
# ring (TLS for the API server client) compiles C.
command -v cc >/dev/null || missing+=(gcc)
# The control plane's certificates, and its readiness checks.
command -v openssl >/dev/null || missing+=(openssl)
command -v curl >/dev/null || missing+=(curl)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]}" >&2
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
fi
# The restart tests mount a FUSE filesystem that never answers (a hung mount).
if [ ! -e /dev/fuse ]; then
  modprobe fuse 2>/dev/null || true
  [ -e /dev/fuse ] || mknod -m 0666 /dev/fuse c 10 229 || true
fi

log=$(mktemp)
plane=$(mktemp -d /tmp/kubevol-control-plane.XXXXXX)
trap 'tools/k8s/control-plane.sh down "$plane"; rm -f "$log"' EXIT
tools/k8s/control-plane.sh up "$plane" >/dev/null
echo "a real control plane serves on https://127.0.0.1:$(cat "$plane/port") (logs in $plane while the tests run)" >&2
# The kubelet's own volume code, which the benchmark's tests measure kubevol beside.
KUBEVOL_KUBELET_HARNESS=$(tools/k8s/build-harness.sh | tail -1)/kubelet-harness
export KUBEVOL_KUBELET_HARNESS
# The library as an agent that feeds pods itself builds it (without kube-rs, axum and notify):
# it builds, and the embedding example runs (in a private mount namespace it enters itself).
echo "building and running the library without its default features (examples/embed.rs)" >&2
cargo run --quiet -p kubevol --no-default-features --example embed >/dev/null
# Every test binary runs even when one fails, so one run shows every failure. A test that takes
# another way than the one it is about (the kernel cannot) says so in $KUBEVOL_TEST_SKIPS.
status=0
skips=$(mktemp -d)
trap 'tools/k8s/control-plane.sh down "$plane"; rm -f "$log"; rm -rf "$skips"' EXIT
KUBEVOL_TEST_SKIPS=$skips KUBEVOL_TEST_CLUSTER=$plane cargo test --workspace --no-fail-fast "$@" 2>&1 | tee "$log" || status=$?
# cargo's last line belongs to whichever crate ran last (often doc tests with 0 tests): close
# with the total of every test binary.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed;?$/) p += $i; if ($(i+1) ~ /^failed;?$/) f += $i } }
     END { printf "all tests: %d passed, %d failed\n", p, f }' "$log"
for f in "$skips"/*.txt; do
  if [ -e "$f" ]; then cat "$f"; fi
done
exit "$status"
