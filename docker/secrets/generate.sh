#!/bin/sh
# docker/secrets/generate.sh [DIR]: random keys for a deployment, one file each, mode 0600, in
# DIR (default: this folder, what docker/compose.cpu.yaml mounts; git ignores them). A file that
# exists is kept. The same files make the Kubernetes Secret (docker/k8s/secrets.yaml).
#   admin-key      Triton's admin APIs (header triton-epd-admin-key)
#   peer-key       what the PD servers send and the encoder servers require
#   tenant-secret  signs the tenants (python_backends/request/tenants.py)
#   api-keys       the OpenAI API's keys, 'KEY TENANT' lines (client/openai_server/auth.py)
# Compose bind-mounts each file with its owner and mode, and the launcher refuses key files others
# may read, so there they must be the containers' user's: run as root (sudo), this gives them to
# 10001:10001. For `kubectl create secret` run it as yourself (kubectl reads them).
set -eu
dir=${1:-$(dirname "$0")}
umask 077
mkdir -p "$dir"
# 32 random bytes, base64url without padding: 43 characters the launcher's key pattern accepts.
key() { head -c 32 /dev/urandom | base64 | tr -d '=\n' | tr '+/' '-_'; }
for name in admin-key peer-key tenant-secret; do
    [ -e "$dir/$name" ] || { key; echo; } > "$dir/$name"
done
# One key for tenant 'demo'; add a line per client ('KEY TENANT'; '-' names no tenant).
[ -e "$dir/api-keys" ] || printf '%s demo\n' "$(key)" > "$dir/api-keys"
if [ "$(id -u)" -eq 0 ]; then
    chown 10001:10001 "$dir/admin-key" "$dir/peer-key" "$dir/tenant-secret" "$dir/api-keys"
fi
echo "keys in $dir: admin-key peer-key tenant-secret api-keys (the OpenAI API's key is in api-keys)"
