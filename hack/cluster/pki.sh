# Certificates and kubeconfigs, made once per cluster with openssl; sourced by lib.sh.
#
# One CA signs everything (etcd, the API server, every client). Each component has its own
# identity, as kubeadm sets them up: the kubelet is system:node:<node> in system:nodes (so the
# Node authorizer and NodeRestriction apply to it), the controller manager and the scheduler
# their system: users, kube-proxy system:kube-proxy, and the admin is in system:masters.
# shellcheck shell=bash

# cert NAME CN ORG USAGE [SAN,...]: a key and a certificate signed by the cluster CA.
cert() {
  local name="$1" cn="$2" org="$3" usage="$4" sans="${5:-}"
  local subj="/CN=$cn"
  [ -f "$PKI/$name.crt" ] && return 0
  [ -n "$org" ] && subj="/O=$org$subj"
  openssl genrsa -out "$PKI/$name.key" 2048 2>/dev/null
  openssl req -new -key "$PKI/$name.key" -subj "$subj" -out "$PKI/$name.csr" 2>/dev/null
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$usage"
    [ -n "$sans" ] && echo "subjectAltName=$sans"
  } >"$PKI/$name.ext"
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -days 365 -sha256 -extfile "$PKI/$name.ext" -out "$PKI/$name.crt" 2>/dev/null
  rm -f "$PKI/$name.csr" "$PKI/$name.ext"
}

# kubeconfig NAME: a kubeconfig for the client certificate NAME, talking to the API server at
# $API_SERVER (a node of its own network namespace reaches it through the machine's address).
kubeconfig() {
  local name="$1" file="$PKI/$1.kubeconfig"
  [ -f "$file" ] && return 0
  cat >"$file" <<EOF
apiVersion: v1
kind: Config
clusters:
  - name: tandem
    cluster:
      server: $API_SERVER
      certificate-authority: $PKI/ca.crt
users:
  - name: $name
    user:
      client-certificate: $PKI/$name.crt
      client-key: $PKI/$name.key
contexts:
  - name: tandem
    context: {cluster: tandem, user: $name}
current-context: tandem
EOF
  chmod 600 "$file"
}

# node_certs PREFIX: the node's own credentials, $PKI/PREFIX{kubelet,kubelet-server,kube-proxy}:
# its kubelet as system:node:$NODE_NAME, serving on $HOST_IP, and its kube-proxy.
node_certs() {
  local p="$1"
  cert "${p}kubelet-server" "system:node:$NODE_NAME" system:nodes serverAuth "IP:127.0.0.1,IP:$HOST_IP,DNS:$NODE_NAME"
  cert "${p}kubelet" "system:node:$NODE_NAME" system:nodes clientAuth
  cert "${p}kube-proxy" system:kube-proxy "" clientAuth
  kubeconfig "${p}kubelet"
  kubeconfig "${p}kube-proxy"
}

make_pki() {
  mkdir -p "$PKI"
  chmod 700 "$PKI"
  if [ ! -f "$PKI/ca.crt" ]; then
    openssl req -x509 -newkey rsa:2048 -nodes -keyout "$PKI/ca.key" -out "$PKI/ca.crt" -days 365 \
      -subj "/CN=tandem-cluster-ca" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  fi
  local ip="$HOST_IP"
  cert etcd-server etcd "" serverAuth,clientAuth "IP:127.0.0.1,DNS:localhost"
  cert apiserver-etcd-client kube-apiserver-etcd-client "" clientAuth
  cert apiserver kube-apiserver "" serverAuth \
    "IP:127.0.0.1,IP:$ip,IP:$API_SERVICE_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  cert apiserver-kubelet-client kube-apiserver-kubelet-client "" clientAuth
  node_certs ""
  cert controller-manager system:kube-controller-manager "" clientAuth
  cert scheduler system:kube-scheduler "" clientAuth
  cert admin tandem-cluster-admin system:masters clientAuth
  for name in controller-manager scheduler admin; do kubeconfig "$name"; done
  # Service-account tokens are signed with this key and verified with its public half.
  if [ ! -f "$PKI/sa.key" ]; then
    openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
    openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
  fi
}
