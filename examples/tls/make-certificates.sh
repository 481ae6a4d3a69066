#!/usr/bin/env bash
# A self-signed CA, a server certificate it signs (for localhost and 127.0.0.1) and a client certificate for
# mutual TLS, with the openssl command: ./make-certificates.sh FOLDER. For trying TLS; in production the
# certificates come from your CA (or cert-manager, ACME...), and layerserve re-reads them when they are renewed.
set -euo pipefail
folder=${1:-tls}
mkdir -p "$folder" && cd "$folder"
key="-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes"
openssl req -x509 $key -days 365 -subj /CN=layerserve-example-ca -keyout ca.key -out ca.crt 2>/dev/null
openssl req $key -subj /CN=localhost -keyout server.key -out server.csr 2>/dev/null
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 90 -out server.crt \
  -extfile <(printf "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth") 2>/dev/null
openssl req $key -subj /CN=example-client -keyout client.key -out client.csr 2>/dev/null
openssl x509 -req -in client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 90 -out client.crt \
  -extfile <(printf "extendedKeyUsage=clientAuth") 2>/dev/null
rm -f server.csr client.csr ca.srl
echo "in $(pwd): ca.crt, server.crt + server.key, client.crt + client.key"
