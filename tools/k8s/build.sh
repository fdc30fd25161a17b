#!/usr/bin/env bash
# Builds the real control plane the cluster tests run against — kube-apiserver,
# kube-controller-manager and etcd of the Kubernetes release pinned in go.mod — from the Go
# module proxy, into target/k8s/<release>/bin. A second run with the same go.mod and go.sum
# only checks a stamp (and Go's own caches make a rebuild after a change cheap).
#
# KUBEVOL_K8S_RELEASE picks the release: 1.37 (go.mod, the default) or 1.36 (v1.36/go.mod, the
# previous release, still supported).
#
# Prints the directory of the binaries on its last line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
case "${KUBEVOL_K8S_RELEASE:-1.37}" in
  1.37) module=$here ;;
  1.36) module=$here/v1.36 ;;
  *)
    echo "build.sh: KUBEVOL_K8S_RELEASE=$KUBEVOL_K8S_RELEASE: the releases kubevol is tested with are 1.37 (the default) and 1.36" >&2
    exit 1
    ;;
esac
release=$(awk '$1 == "k8s.io/kubernetes" { print $2 }' "$module/go.mod")
out=${KUBEVOL_K8S_BIN:-$top/target/k8s/$release/bin}
stamp=$(cat "$module/go.mod" "$module/go.sum" "$module"/etcd/*.go "$0" | sha256sum | cut -c1-16)
if [ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$stamp" ] &&
  [ -x "$out/kube-apiserver" ] && [ -x "$out/kube-controller-manager" ] && [ -x "$out/etcd" ]; then
  echo "$out"
  exit 0
fi
command -v go >/dev/null || {
  echo "build.sh: Go is needed to build the control plane (go.mod names go $(awk '$1 == "go" { print $2 }' "$module/go.mod"))" >&2
  exit 1
}
mkdir -p "$out"
echo "building kube-apiserver, kube-controller-manager ($release) and etcd into $out (once; several minutes on 2 cores)" >&2
start=$(date +%s)
# -trimpath and no VCS stamp: the same inputs give the same binaries wherever the repo is.
(cd "$module" && CGO_ENABLED=0 go build -trimpath -buildvcs=false -ldflags=-s -o "$out/" \
  ./etcd k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager)
echo "$stamp" >"$out/.stamp"
echo "built in $(($(date +%s) - start)) s" >&2
echo "$out"
