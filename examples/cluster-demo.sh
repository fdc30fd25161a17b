#!/usr/bin/env bash
# kubevol as the node of a real cluster (`./run-demo.sh --cluster`): starts the project's
# control plane (tools/k8s: kube-apiserver with Node,RBAC and NodeRestriction,
# kube-controller-manager, etcd) on loopback, makes the node's credentials (a client
# certificate of system:node:demo), runs `kubevol run --kubeconfig` as node `demo` in a private
# mount namespace beside the loop-device CSI driver, and creates a pod with every kind of
# volume: a CSI claim whose driver requires attach, a hostPath PersistentVolume's claim, a
# ConfigMap (then changed), an emptyDir and the kube-api-access token volume the API server
# adds. The control plane's PersistentVolume binder binds the claims; the script plays the
# attach/detach controller (the VolumeAttachment and the Node's volumesAttached; the loop
# driver attaches at stage). It prints kubevol's table, the Node's volumesInUse and the pod's Events, deletes the
# pod, and removes everything when it exits. Needs root, Go (the first run builds the control
# plane, a few minutes), openssl, curl and e2fsprogs.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --bin kubevol --bin kubevol-csi-loop
bin="$(cd "${CARGO_TARGET_DIR:-target}/release" && pwd)"
work=$(mktemp -d /tmp/kubevol-cluster-demo.XXXXXX)
plane="$work/control-plane"
root="$work/root"
daemon=
cleanup() {
  if [ -n "$daemon" ]; then
    kill -TERM "$daemon" 2>/dev/null || true
    wait "$daemon" 2>/dev/null || true
  fi
  tools/k8s/control-plane.sh down "$plane" || true
  rm -rf --one-file-system "$work"
}
trap cleanup EXIT

echo "starting the control plane (the first run builds it from the Go module proxy)..." >&2
tools/k8s/control-plane.sh up "$plane" >/dev/null
port=$(cat "$plane/port")
kubeconfig=$(tools/k8s/control-plane.sh node "$plane" demo)

# api METHOD PATH [JSON]: a request as the cluster's administrator; prints the answer.
api() {
  local type=application/json
  [ "$1" = PATCH ] && type=application/merge-patch+json
  # (not curl's own user agent: the API server indents its answers to curl)
  curl -sS --fail-with-body -A kubevol-demo --cacert "$plane/ca.crt" --cert "$plane/admin.crt" \
    --key "$plane/admin.key" -X "$1" -H "Content-Type: $type" \
    "https://127.0.0.1:$port$2" ${3:+--data "$3"}
}
# until_true WHAT SECS COMMAND...: polls COMMAND until it succeeds.
until_true() {
  local what=$1 secs=$2 deadline=$((SECONDS + $2))
  shift 2
  until "$@" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "cluster-demo: $what did not happen within $secs s; kubevol's log:" >&2
      tail -20 "$work/kubevol.log" >&2 || true
      [ -n "$daemon" ] && "$bin/kubevol" status --server "http://$listen" -o wide >&2 || true
      exit 1
    fi
    sleep 0.2
  done
}

driver=loop.csi.kubevol.io
mkdir -p "$work/host-data"
echo "kept on the host" >"$work/host-data/README"
api POST /apis/storage.k8s.io/v1/csidrivers \
  '{"metadata":{"name":"'$driver'"},"spec":{"attachRequired":true,"podInfoOnMount":true,"volumeLifecycleModes":["Persistent"]}}' >/dev/null
api POST /api/v1/persistentvolumes '{"metadata":{"name":"demo-data"},"spec":{"capacity":{"storage":"16Mi"},
  "accessModes":["ReadWriteOnce"],"claimRef":{"namespace":"default","name":"data"},
  "csi":{"driver":"'$driver'","volumeHandle":"demo-data","fsType":"ext4","volumeAttributes":{"size":"16Mi"}}}}' >/dev/null
api POST /api/v1/persistentvolumes '{"metadata":{"name":"demo-host"},"spec":{"capacity":{"storage":"1Gi"},
  "accessModes":["ReadWriteOnce"],"claimRef":{"namespace":"default","name":"host"},
  "hostPath":{"path":"'"$work/host-data"'","type":"Directory"}}}' >/dev/null
for claim in data:demo-data:16Mi host:demo-host:1Gi; do
  IFS=: read -r name pv size <<<"$claim"
  api POST /api/v1/namespaces/default/persistentvolumeclaims '{"metadata":{"name":"'$name'"},
    "spec":{"accessModes":["ReadWriteOnce"],"resources":{"requests":{"storage":"'$size'"}},"volumeName":"'$pv'","storageClassName":""}}' >/dev/null
  # The control plane's PersistentVolume binder binds it to its volume.
done
api POST /api/v1/namespaces/default/configmaps '{"metadata":{"name":"app-config"},"data":{"level":"info"}}' >/dev/null
pod=$(api POST /api/v1/namespaces/default/pods '{"metadata":{"name":"app"},"spec":{"nodeName":"demo",
  "containers":[{"name":"app","image":"busybox","volumeMounts":[{"name":"data","mountPath":"/data"},
    {"name":"host","mountPath":"/host"},{"name":"config","mountPath":"/config"},{"name":"scratch","mountPath":"/scratch"}]}],
  "volumes":[{"name":"data","persistentVolumeClaim":{"claimName":"data"}},{"name":"host","persistentVolumeClaim":{"claimName":"host"}},
    {"name":"config","configMap":{"name":"app-config"}},{"name":"scratch","emptyDir":{}}]}}')
uid=$(printf '%s' "$pod" | grep -o '"uid":"[^"]*"' | head -1 | cut -d'"' -f4)

listen="127.0.0.1:$((20000 + RANDOM % 40000))"
mkdir -p "$root"
KUBEVOL_NODE_ID=demo RUST_LOG=${RUST_LOG:-warn} unshare --mount --propagation private \
  examples/with-loop-driver.sh "$bin" "$root" \
  "$bin/kubevol" run --kubeconfig "$kubeconfig" --node-name demo --register-node \
  --root-dir "$root" --listen "$listen" 2>"$work/kubevol.log" &
daemon=$!

# The attach/detach controller's part, once the node reports the volume in use.
unique="kubernetes.io/csi/$driver^demo-data"
in_use() { api GET /api/v1/nodes/demo | grep -qF "\"volumesInUse\":[\"$unique\""; }
until_true "the node reporting the CSI volume in use" 60 in_use
attachment="csi-$(printf '%s' "demo-data${driver}demo" | sha256sum | cut -d' ' -f1)"
api POST /apis/storage.k8s.io/v1/volumeattachments '{"metadata":{"name":"'$attachment'"},
  "spec":{"attacher":"'$driver'","nodeName":"demo","source":{"persistentVolumeName":"demo-data"}}}' >/dev/null
api PATCH "/apis/storage.k8s.io/v1/volumeattachments/$attachment/status" '{"status":{"attached":true}}' >/dev/null
api PATCH /api/v1/nodes/demo/status '{"status":{"volumesAttached":[{"name":"'$unique'","devicePath":""}]}}' >/dev/null

ready() {
  local rows
  rows=$("$bin/kubevol" status --server "http://$listen" | grep '^default/app ') || return 1
  ! printf '%s\n' "$rows" | grep -qv Mounted
}
until_true "the pod's volumes mounted" 120 ready
# A ConfigMap update reaches the volume.
level="$root/pods/$uid/volumes/kubernetes.io~configmap/config/level"
api PUT /api/v1/namespaces/default/configmaps/app-config '{"metadata":{"name":"app-config"},"data":{"level":"debug"}}' >/dev/null
updated() { [ "$(cat "$level")" = debug ]; }
until_true "the ConfigMap update in the volume" 60 updated

"$bin/kubevol" status --server "http://$listen"
echo
echo "The ConfigMap's update, in the volume: level=$(cat "$level")"
echo "Node demo's status.volumesInUse: $(api GET /api/v1/nodes/demo | grep -o '"volumesInUse":\[[^]]*\]' | cut -d: -f2-)"
echo
echo "Events of the pod:"
api GET "/api/v1/namespaces/default/events?fieldSelector=involvedObject.uid%3D$uid" |
  grep -o '"reason":"[^"]*","message":"\([^"\\]\|\\.\)*"' |
  sed -e 's/"reason":"\([^"]*\)","message":"\(.*\)"$/  \1: \2/' -e 's/\\"/"/g' ||
  echo "  (none: nothing failed, and a successful mount is not posted)"

# Deleted: torn down, then the node reports nothing in use.
api DELETE "/api/v1/namespaces/default/pods/app?gracePeriodSeconds=0" >/dev/null
released() { ! api GET /api/v1/nodes/demo | grep -q '"volumesInUse":\["'; }
until_true "the pod's volumes torn down" 60 released
echo
echo "Pod deleted: every volume torn down, Node demo's status.volumesInUse is empty again."
