#!/usr/bin/env bash
# make-test-ca.sh — TEST key material for a fedmf / Flower 1.42 federation (not for production).
#
#   deploy/make-test-ca.sh OUT_DIR [N_SUPERNODES=2] [EXTRA_SAN ...]
#
# Writes into OUT_DIR (created 0700; refuses to overwrite an existing ca.key):
#   ca.key            0600  test CA private key (EC P-384)
#   ca.crt            0644  test CA certificate (10 days) -> SuperLink --ssl-ca-certfile,
#                           SuperNode --root-certificates, config.toml root-certificates
#   server.key        0600  SuperLink TLS private key  -> --ssl-keyfile
#   server.crt        0644  SuperLink TLS certificate, SAN IP:127.0.0.1, DNS:localhost (+ EXTRA_SAN:
#                           "IP:10.0.0.5" / "DNS:link.example.org") -> --ssl-certfile
#   supernode-I       0600  SuperNode I's node-authentication private key, OpenSSH format, ECDSA
#                           P-384 (what `flower-supernode --auth-supernode-private-key` loads)
#   supernode-I.pub   0644  its public key (`ecdsa-sha2-nistp384 …`, what
#                           `flwr supernode register KEY.pub <connection>` accepts)
#   for I in 0 .. N-1.
#
# The CA is a throw-away for tests and walk-throughs: for a real federation use your
# organisation's CA for the server certificate. The node keys are fine to keep (generate them on
# each SuperNode's machine and ship only the .pub to the SuperLink operator).
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
out=$1; n=${2:-2}; shift; [[ $# -gt 0 ]] && shift
[[ "$n" =~ ^[0-9]+$ ]] || { echo "make-test-ca.sh: N_SUPERNODES must be a number, got '$n'" >&2; exit 2; }
command -v openssl >/dev/null || { echo "make-test-ca.sh: openssl not found" >&2; exit 1; }
command -v ssh-keygen >/dev/null || { echo "make-test-ca.sh: ssh-keygen (openssh-client) not found" >&2; exit 1; }

umask 077
mkdir -p "$out"
chmod 700 "$out"
cd "$out"
if [[ -e ca.key ]]; then
    echo "make-test-ca.sh: $out/ca.key exists; refusing to overwrite" >&2
    exit 1
fi

san="IP:127.0.0.1,DNS:localhost"
for extra in "$@"; do san="$san,$extra"; done

# --- CA ---------------------------------------------------------------------------------------
openssl ecparam -name secp384r1 -genkey -noout -out ca.key
openssl req -x509 -new -key ca.key -sha384 -days 10 -subj "/CN=fedmf test CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out ca.crt 2>/dev/null

# --- SuperLink server certificate ---------------------------------------------------------------
openssl ecparam -name secp384r1 -genkey -noout -out server.key
openssl req -new -key server.key -sha384 -subj "/CN=localhost" -out server.csr 2>/dev/null
cat > server.ext <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=$san
EXT
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -sha384 -days 10 \
    -extfile server.ext -out server.crt 2>/dev/null
rm -f server.csr server.ext ca.srl
openssl verify -CAfile ca.crt server.crt >/dev/null

# --- SuperNode node-authentication key pairs (OpenSSH ECDSA P-384) -------------------------------
for ((i = 0; i < n; i++)); do
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "fedmf-supernode-$i" -f "supernode-$i"
done

chmod 600 ca.key server.key
chmod 644 ca.crt server.crt
for ((i = 0; i < n; i++)); do chmod 600 "supernode-$i"; chmod 644 "supernode-$i.pub"; done
echo "make-test-ca.sh: wrote test CA, SuperLink certificate ($san) and $n SuperNode key pairs to $PWD"
