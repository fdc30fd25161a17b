#!/usr/bin/env bash
# Builds kubelet-harness — the kubelet's own volume code (SetVolumeOwnership; see
# kubelet-harness/main.go) of the Kubernetes release pinned in go.mod — from the Go module proxy,
# into target/k8s/<release>/bin, for `kubevol bench` to measure kubevol side by side with it.
# A second run with the same inputs only checks a stamp.
#
# Prints the directory of the binary on its last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
release=$(awk '$1 == "k8s.io/kubernetes" { print $2 }' "$here/go.mod")
out=${KUBEVOL_K8S_BIN:-$top/target/k8s/$release/bin}
stamp=$(cat "$here/go.mod" "$here/go.sum" "$here"/kubelet-harness/*.go "$0" | sha256sum | cut -c1-16)
if [ -f "$out/.harness-stamp" ] && [ "$(cat "$out/.harness-stamp")" = "$stamp" ] && [ -x "$out/kubelet-harness" ]; then
  echo "$out"
  exit 0
fi
command -v go >/dev/null || {
  echo "build-harness.sh: Go is needed to build the kubelet harness" >&2
  exit 1
}
mkdir -p "$out"
echo "building kubelet-harness ($release) into $out (once)" >&2
(cd "$here" && CGO_ENABLED=0 go build -trimpath -buildvcs=false -ldflags=-s -o "$out/kubelet-harness" ./kubelet-harness)
echo "$stamp" >"$out/.harness-stamp"
echo "$out"
