#!/usr/bin/env bash
# A real control plane on loopback, for the cluster tests and the cluster demo: etcd,
# kube-apiserver (Node,RBAC authorization, NodeRestriction, a service-account issuer, an audit
# log of every node's requests) and kube-controller-manager (the controllers a node relies on),
# built by build.sh.
#
#   control-plane.sh up DIR      builds if needed, makes a CA and credentials in DIR (a new
#                                directory), starts the three and waits until they serve;
#                                prints DIR. DIR/admin.kubeconfig is an administrator's.
#   control-plane.sh node DIR N  makes DIR/nodes/N.kubeconfig, a client certificate of node N
#                                (CN=system:node:N, O=system:nodes); prints its path.
#   control-plane.sh down DIR    stops what `up` started (by the PIDs it recorded) and
#                                removes DIR.
#
# Each process's log is DIR/<name>.log; DIR/audit.log has the requests of group system:nodes.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
self="$here/$(basename "$0")"

die() {
  echo "control-plane.sh: $*" >&2
  exit 1
}

# A TCP port on 127.0.0.1 that nothing listens on now, outside the kernel's range of ephemeral
# ports (net.ipv4.ip_local_port_range): a port in it can be given to any outgoing connection
# (the API server's own to etcd among them) between this pick and the listener's bind.
free_port() {
  local p low=32768 high=60999 lo hi
  read -r low high </proc/sys/net/ipv4/ip_local_port_range || true
  if [ "$low" -gt 11024 ]; then
    lo=10000 hi=$((low - 1))
  elif [ "$high" -lt 64511 ]; then
    lo=$((high + 1)) hi=65535
  else
    lo=1024 hi=65535
  fi
  for _ in $(seq 1 200); do
    p=$((lo + (RANDOM * 32768 + RANDOM) % (hi - lo + 1)))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
      echo "$p"
      return
    fi
  done
  die "no free port on 127.0.0.1"
}

# key NAME: an EC P-256 key in PKCS#8.
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1.key" 2>/dev/null; }

# cert DIR NAME SUBJECT [SANS]: DIR/NAME.crt and .key, signed by DIR's CA (a server's
# certificate where SANS are given, a client's otherwise). NAME may have a folder.
cert() {
  local dir=$1 name=$2 subject=$3 sans=${4:-}
  key "$dir/$name"
  openssl req -new -key "$dir/$name.key" -subj "$subject" -out "$dir/$name.csr" 2>/dev/null
  printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
    "extendedKeyUsage=${sans:+serverAuth,}clientAuth" ${sans:+"subjectAltName=$sans"} >"$dir/$name.ext"
  openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days 7 -sha256 -extfile "$dir/$name.ext" \
    -out "$dir/$name.crt" 2>/dev/null
  rm -f "$dir/$name.csr" "$dir/$name.ext"
}

# kubeconfig DIR NAME USER OUT: a kubeconfig of DIR's server with NAME.crt/key embedded.
kubeconfig() {
  local dir=$1 name=$2 user=$3 out=$4
  local b64="base64 -w0"
  cat >"$out" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kubevol-test
  cluster:
    server: https://127.0.0.1:$(cat "$dir/port")
    certificate-authority-data: $($b64 <"$dir/ca.crt")
users:
- name: $user
  user:
    client-certificate-data: $($b64 <"$dir/$name.crt")
    client-key-data: $($b64 <"$dir/$name.key")
contexts:
- name: $user
  context: {cluster: kubevol-test, user: $user}
current-context: $user
EOF
}

# start DIR NAME COMMAND...: runs COMMAND in its own session, logging to DIR/NAME.log.
start() {
  local dir=$1 name=$2
  shift 2
  setsid "$@" >"$dir/$name.log" 2>&1 </dev/null &
  echo "$!" >>"$dir/pids"
  echo "$name $!" >>"$dir/processes"
}

# until_ok DIR WHAT SECS URL: polls URL with the admin's certificate until it answers 200.
until_ok() {
  local dir=$1 what=$2 secs=$3 url=$4 deadline=$((SECONDS + $3))
  while ! curl -sf --cacert "$dir/ca.crt" --cert "$dir/admin.crt" --key "$dir/admin.key" \
    -o /dev/null "$url" 2>/dev/null; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "control-plane.sh: $what did not become ready within ${secs} s; the last lines of its log:" >&2
      tail -20 "$dir/$what.log" >&2 || true
      "$self" down "$dir" || true
      exit 1
    fi
    # A process that died will not become ready.
    while read -r name pid; do
      kill -0 "$pid" 2>/dev/null && continue
      echo "control-plane.sh: $name exited; the last lines of its log:" >&2
      tail -20 "$dir/$name.log" >&2 || true
      "$self" down "$dir" || true
      exit 1
    done <"$dir/processes"
    sleep 0.2
  done
}

up() {
  local dir=$1
  [ -e "$dir" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ] && die "$dir exists and is not empty"
  for tool in openssl curl setsid; do
    command -v "$tool" >/dev/null || die "$tool is needed (apt-get install openssl curl util-linux)"
  done
  local bin
  bin=$("$here/build.sh" | tail -1)
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  : >"$dir/pids"
  : >"$dir/processes"
  # What has the directory can mint nodes (the tests do): `DIR/control-plane.sh node DIR N`.
  ln -s "$self" "$dir/control-plane.sh"

  # The CA (also the controller manager's signer), the server's certificate, the clients'.
  key "$dir/ca"
  openssl req -x509 -new -key "$dir/ca.key" -subj "/CN=kubevol-test-ca" -days 7 -sha256 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$dir/ca.crt" 2>/dev/null
  cert "$dir" apiserver "/CN=kube-apiserver" \
    "IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
  cert "$dir" admin "/O=system:masters/CN=kubevol-test-admin"
  cert "$dir" controller-manager "/CN=system:kube-controller-manager"
  cert "$dir" controller-manager-serving "/CN=kube-controller-manager" "IP:127.0.0.1,DNS:localhost"
  key "$dir/service-account"
  openssl pkey -in "$dir/service-account.key" -pubout -out "$dir/service-account.pub" 2>/dev/null
  cat >"$dir/audit-policy.yaml" <<'EOF'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  userGroups: ["system:nodes"]
- level: None
EOF

  local etcd_port peer_port port kcm_port
  etcd_port=$(free_port)
  peer_port=$(free_port)
  port=$(free_port)
  kcm_port=$(free_port)
  echo "$port" >"$dir/port"
  echo "$etcd_port" >"$dir/etcd-port"

  start "$dir" etcd "$bin/etcd" --name kubevol-test --data-dir "$dir/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-cluster "kubevol-test=http://127.0.0.1:$peer_port" \
    --unsafe-no-fsync --log-level warn

  # The release's defaults, as a cluster of it is run: in 1.37 ClusterTrustBundles and
  # PodCertificateRequests are GA and served at certificates.k8s.io/v1 with no flag (kubevol
  # finds the version by discovery). 1.36 has them in beta, off by default: its plane turns
  # them on, and their v1beta1 API, as a 1.36 cluster that uses them must.
  local gates="" runtime_config=""
  if [ "${KUBEVOL_K8S_RELEASE:-1.37}" = 1.36 ]; then
    gates=ClusterTrustBundle=true,ClusterTrustBundleProjection=true,PodCertificateRequest=true
    runtime_config=certificates.k8s.io/v1beta1/clustertrustbundles=true,certificates.k8s.io/v1beta1/podcertificaterequests=true
  fi
  # The alpha gates of the features the cluster tests are about (a server without them drops
  # those fields), each turned on where the server has it: its --help lists the gates it knows
  # (a binary built from the module proxy reports no release in --version).
  local known gate
  known=$("$bin/kube-apiserver" --help 2>&1)
  for gate in EmptyDirVolumeMode AtomicWriteVolumeUserFields InPlacePodVerticalScalingMemoryBackedVolumes CSIVolumeHealth; do
    case $known in *"$gate=true|false"*) gates=${gates:+$gates,}$gate=true ;; esac
  done
  start "$dir" kube-apiserver "$bin/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$etcd_port" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$port" \
    --endpoint-reconciler-type none \
    --tls-cert-file "$dir/apiserver.crt" --tls-private-key-file "$dir/apiserver.key" \
    --client-ca-file "$dir/ca.crt" \
    --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
    --service-account-issuer https://kubernetes.default.svc \
    --service-account-key-file "$dir/service-account.pub" \
    --service-account-signing-key-file "$dir/service-account.key" \
    --service-cluster-ip-range 10.0.0.0/24 \
    ${gates:+--feature-gates "$gates"} \
    ${runtime_config:+--runtime-config "$runtime_config"} \
    --audit-policy-file "$dir/audit-policy.yaml" --audit-log-path "$dir/audit.log" \
    --audit-log-format json --audit-log-mode blocking \
    --watch-cache-sizes configmaps#0 \
    --allow-privileged --profiling=false --v 1
  until_ok "$dir" kube-apiserver 120 "https://127.0.0.1:$port/readyz"

  kubeconfig "$dir" admin kubevol-test-admin "$dir/admin.kubeconfig"
  kubeconfig "$dir" controller-manager system:kube-controller-manager "$dir/controller-manager.kubeconfig"
  start "$dir" kube-controller-manager "$bin/kube-controller-manager" \
    --kubeconfig "$dir/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$dir/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$dir/controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$kcm_port" \
    --tls-cert-file "$dir/controller-manager-serving.crt" \
    --tls-private-key-file "$dir/controller-manager-serving.key" \
    --service-account-private-key-file "$dir/service-account.key" --root-ca-file "$dir/ca.crt" \
    --cluster-signing-cert-file "$dir/ca.crt" --cluster-signing-key-file "$dir/ca.key" \
    --use-service-account-credentials \
    --controllers serviceaccount-controller,serviceaccount-token-controller,root-ca-certificate-publisher-controller,namespace-controller,garbage-collector-controller,persistentvolume-binder-controller,persistentvolume-protection-controller,persistentvolumeclaim-protection-controller,ephemeral-volume-controller \
    --leader-elect=false --profiling=false --v 1
  until_ok "$dir" kube-controller-manager 120 "https://127.0.0.1:$kcm_port/healthz"
  # The serviceaccount controller has made the default namespace's account: pods can be
  # created.
  until_ok "$dir" kube-controller-manager 60 "https://127.0.0.1:$port/api/v1/namespaces/default/serviceaccounts/default"
  echo "$dir"
}

node() {
  local dir=$1 name=$2
  [ -f "$dir/ca.key" ] || die "$dir is not a control plane's directory"
  mkdir -p "$dir/nodes"
  cert "$dir" "nodes/$name" "/O=system:nodes/CN=system:node:$name"
  kubeconfig "$dir" "nodes/$name" "system:node:$name" "$dir/nodes/$name.kubeconfig"
  echo "$dir/nodes/$name.kubeconfig"
}

down() {
  local dir=$1
  [ -d "$dir" ] || return 0
  if [ -f "$dir/pids" ]; then
    # The controller manager first, etcd last.
    for pid in $(tac "$dir/pids"); do
      kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in $(tac "$dir/pids"); do
      for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
      done
      kill -KILL "$pid" 2>/dev/null || true
    done
  fi
  rm -rf "$dir"
}

case "${1:-}" in
up) [ $# -eq 2 ] || die "usage: control-plane.sh up DIR"; up "$2" ;;
node) [ $# -eq 3 ] || die "usage: control-plane.sh node DIR NAME"; node "$2" "$3" ;;
down) [ $# -eq 2 ] || die "usage: control-plane.sh down DIR"; down "$2" ;;
*) die "usage: control-plane.sh up DIR | node DIR NAME | down DIR" ;;
esac
