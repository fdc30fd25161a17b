#!/usr/bin/env bash
# Usage: with-loop-driver.sh BIN_DIR ROOT COMMAND [ARGS...]
#
# Runs COMMAND with kubevol's loop-device CSI driver serving beside it: the driver keeps its
# volumes in ROOT/csi-data, listens on ROOT/csi/csi.sock and registers through
# ROOT/plugins_registry (where `kubevol run --root-dir ROOT` looks). COMMAND sees
# KUBEVOL_CSI_CONTROLLER=loop.csi.kubevol.io=unix://ROOT/csi/csi.sock, the value of kubevol's
# --csi-controller flag for attach and detach. Afterwards the driver is stopped and the loop
# devices of its volumes are detached. Run it inside a private mount namespace
# (unshare --mount --propagation private): the mounts then vanish with the namespace.
set -uo pipefail
bin=$1 root=$2
shift 2
mkdir -p "$root/csi" "$root/plugins_registry"
"$bin/kubevol-csi-loop" --endpoint "unix://$root/csi/csi.sock" --data-dir "$root/csi-data" \
  --node-id "${KUBEVOL_NODE_ID:-demo}" --registration-dir "$root/plugins_registry" \
  --call-log "$root/csi/calls.json" 2>"$root/csi/driver.log" &
driver=$!
for _ in $(seq 100); do
  [ -S "$root/plugins_registry/loop.csi.kubevol.io-reg.sock" ] && break
  sleep 0.05
done
export KUBEVOL_CSI_CONTROLLER="loop.csi.kubevol.io=unix://$root/csi/csi.sock"
# COMMAND runs as a child, so that a TERM sent to this script (a daemon stopped) reaches it
# and the driver is stopped and its devices detached after it.
"$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM INT
status=0
wait "$child" || status=$?
while kill -0 "$child" 2>/dev/null; do
  status=0
  wait "$child" || status=$?
done
kill "$driver" 2>/dev/null
wait "$driver" 2>/dev/null
"$bin/kubevol-csi-loop" --detach-all --data-dir "$root/csi-data"
exit $status
