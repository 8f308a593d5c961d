#!/usr/bin/env bash
# Make the webhook-gateway serving certificate with openssl, for clusters without cert-manager.
#
#   scripts/gen-certs.sh [-n NAMESPACE] [-s SERVICE] [-o DIR] [-d DAYS] [-k ecdsa|rsa] [--new-ca]
#
# Writes, into DIR (default: the repository's deploy/ directory):
#   certs/ca.crt certs/ca.key      a private CA (kept, and reused on the next run)
#   certs/tls.crt certs/tls.key    the serving certificate for SERVICE.NAMESPACE.svc, signed by the CA
#   certs/ca-bundle.pem            the CA(s) the apiserver must trust: pass it to
#                                  `webhook-gateway registration --ca-bundle`
#   tls-secret.yaml                the kubernetes.io/tls Secret webhook-gateway-tls (its ca.crt is
#                                  what the gateway verifies client certificates with, when
#                                  deploy/components/client-auth asks for them)
#   certs/apiserver-client.crt .key           kube-apiserver's client certificate, signed by the CA
#   certs/admission-kubeconfig.yaml           the apiserver's files that present it
#   certs/admission-configuration.yaml        (scripts/apiserver-admission-config.sh; docs/deploy.md)
# and prints the caBundle (base64 PEM) on stdout. Then: kubectl apply -k DIR
#
# Re-running renews the serving certificate under the same CA, so the caBundle does not change
# and rotation needs no coordination. --new-ca makes a new CA; the caBundle then holds the new
# and the previous CA, so the apiserver trusts the gateway before and after its pods pick up the
# new Secret. Run it once more later (without --new-ca) to drop the old CA from the bundle.
#
# Keys are ECDSA P-256 unless -k rsa asks for RSA 2048: the kube-apiserver makes a full TLS handshake
# for every new connection, and signing it with P-256 costs the gateway a fraction of RSA's CPU
# (docs/performance.md). -k applies to the serving and client keys, and to the CA's when a new CA is made.
set -euo pipefail

namespace=webhook-gateway
service=webhook-gateway
secret=webhook-gateway-tls
days=365
new_ca=false
key_type=ecdsa
out="$(cd "$(dirname "$0")/.." && pwd)/deploy"

usage() {
    sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit "${1:-2}"
}

while [ $# -gt 0 ]; do
    case "$1" in
        -n) namespace="$2"; shift 2 ;;
        -s) service="$2"; shift 2 ;;
        -o) out="$2"; shift 2 ;;
        -d) days="$2"; shift 2 ;;
        -k|--key-type) key_type="$2"; shift 2 ;;
        --new-ca) new_ca=true; shift ;;
        -h|--help) usage 0 ;;
        *) echo "unknown argument: $1" >&2; usage ;;
    esac
done

case "$key_type" in
    ecdsa) newkey=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1); key_usage="digitalSignature" ;;
    rsa) newkey=(-newkey rsa:2048); key_usage="digitalSignature, keyEncipherment" ;;
    *) echo "unknown key type: $key_type (ecdsa or rsa)" >&2; usage ;;
esac

command -v openssl >/dev/null || { echo "openssl is required" >&2; exit 1; }
certs="$out/certs"
mkdir -p "$certs"
chmod 700 "$certs"
umask 077
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

dns="$service.$namespace.svc"
previous_ca=""
if [ "$new_ca" = true ] && [ -f "$certs/ca.crt" ]; then
    previous_ca="$(cat "$certs/ca.crt")"
fi

if [ "$new_ca" = true ] || [ ! -f "$certs/ca.key" ] || [ ! -f "$certs/ca.crt" ]; then
    echo "creating a new CA in $certs" >&2
    openssl req -x509 -new -nodes -sha256 -days 3650 \
        "${newkey[@]}" \
        -keyout "$work/ca.key" -out "$work/ca.crt" \
        -subj "/CN=webhook-gateway-ca" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    mv "$work/ca.key" "$certs/ca.key"
    mv "$work/ca.crt" "$certs/ca.crt"
else
    echo "reusing the CA in $certs" >&2
fi

cat >"$work/ext.cnf" <<EOF
basicConstraints = critical, CA:FALSE
keyUsage = critical, $key_usage
extendedKeyUsage = serverAuth
subjectAltName = DNS:$dns, DNS:$dns.cluster.local, DNS:$service.$namespace
EOF
openssl req -new -nodes -sha256 \
    "${newkey[@]}" \
    -keyout "$work/tls.key" -out "$work/tls.csr" -subj "/CN=$dns" 2>/dev/null
openssl x509 -req -sha256 -days "$days" -in "$work/tls.csr" \
    -CA "$certs/ca.crt" -CAkey "$certs/ca.key" -set_serial "0x$(openssl rand -hex 16)" \
    -extfile "$work/ext.cnf" -out "$work/tls.crt" 2>/dev/null
openssl verify -CAfile "$certs/ca.crt" "$work/tls.crt" >/dev/null
mv "$work/tls.key" "$certs/tls.key"
mv "$work/tls.crt" "$certs/tls.crt"

# kube-apiserver's client certificate (deploy/components/client-auth): client authentication only,
# so that it cannot serve, and the serving certificate (server authentication only) cannot log in.
cat >"$work/client.cnf" <<EOF
basicConstraints = critical, CA:FALSE
keyUsage = critical, $key_usage
extendedKeyUsage = clientAuth
EOF
openssl req -new -nodes -sha256 \
    "${newkey[@]}" \
    -keyout "$work/client.key" -out "$work/client.csr" -subj "/CN=kube-apiserver" 2>/dev/null
openssl x509 -req -sha256 -days "$days" -in "$work/client.csr" \
    -CA "$certs/ca.crt" -CAkey "$certs/ca.key" -set_serial "0x$(openssl rand -hex 16)" \
    -extfile "$work/client.cnf" -out "$work/client.crt" 2>/dev/null
openssl verify -CAfile "$certs/ca.crt" -purpose sslclient "$work/client.crt" >/dev/null
mv "$work/client.key" "$certs/apiserver-client.key"
mv "$work/client.crt" "$certs/apiserver-client.crt"
"$(dirname "$0")/apiserver-admission-config.sh" -n "$namespace" -s "$service" -o "$certs" \
    --cert "$certs/apiserver-client.crt" --key "$certs/apiserver-client.key" 2>/dev/null

b64() { base64 <"$1" | tr -d '\n'; }

bundle="$work/bundle.pem"
cat "$certs/ca.crt" >"$bundle"
if [ -n "$previous_ca" ]; then
    printf '%s\n' "$previous_ca" >>"$bundle"
fi
ca_bundle="$(b64 "$bundle")"

cat >"$out/tls-secret.yaml" <<EOF
# Generated by scripts/gen-certs.sh for $dns. Holds a private key: do not commit.
apiVersion: v1
kind: Secret
metadata:
  name: $secret
  namespace: $namespace
  labels:
    app.kubernetes.io/name: webhook-gateway
type: kubernetes.io/tls
data:
  tls.crt: $(b64 "$certs/tls.crt")
  tls.key: $(b64 "$certs/tls.key")
  ca.crt: $(b64 "$certs/ca.crt")
EOF

cp "$bundle" "$certs/ca-bundle.pem"

echo "wrote $out/tls-secret.yaml and $certs/ca-bundle.pem; now: kubectl apply -k $out, wait for" >&2
echo "kubectl rollout status, then compute the registration with --ca-bundle $certs/ca-bundle.pem" >&2
printf '%s\n' "$ca_bundle"
