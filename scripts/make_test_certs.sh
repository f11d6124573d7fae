#!/usr/bin/env bash
# Makes a throwaway certificate authority in DIR (ca.pem, ca.key) and, for
# each NAME, a certificate it signs (NAME.pem, NAME.key; EC P-256, valid one
# day) whose subjectAltName is DNS:NAME, DNS:localhost and IP:127.0.0.1, so
# that it serves both as a server's certificate on this machine and as the
# client certificate of node NAME. For the demos' TLS=1 runs and tests;
# never for a deployment.
#   scripts/make_test_certs.sh DIR NAME...
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 DIR NAME..." >&2; exit 2; }
command -v openssl >/dev/null || { echo "$0: needs the openssl CLI (make deps installs it)" >&2; exit 1; }
dir=$1
shift
mkdir -p "$dir"
cd "$dir"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key \
  -out ca.pem -days 1 -subj /CN=kvtier-demo-ca -addext basicConstraints=critical,CA:TRUE \
  -addext keyUsage=critical,keyCertSign,cRLSign >/dev/null 2>&1
for name in "$@"; do
  printf 'subjectAltName=DNS:%s,DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' \
    "$name" >"$name.ext"
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$name.key" \
    -out "$name.csr" -subj "/CN=$name" >/dev/null 2>&1
  openssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 \
    -extfile "$name.ext" -out "$name.pem" >/dev/null 2>&1
  rm -f "$name.csr" "$name.ext"
done
