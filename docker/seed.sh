#!/bin/sh
# triton-epd-seed SEED_DIR SECRETS_DIR KEYS_DIR: the init container of docker/k8s/'s pods, whose
# root file system is read-only. Before the server starts it
# - copies the image's model_repository/ and build/ into SEED_DIR/model_repository and
#   SEED_DIR/build, the emptyDir volumes the server then mounts in their place (each start
#   rewrites configs and stamps there); -a keeps the artefacts' mtimes, which their stamps record,
#   so nothing is rebuilt;
# - copies each key of the Secret volume SECRETS_DIR into KEYS_DIR, owned by this user, mode 0400:
#   the Secret's own files are root's, 0440 with the pod's fsGroup, and the launcher refuses key
#   files its group may read.
# tests/unit/test_deployment_manifests.py runs it.
set -eu
if [ $# -ne 3 ]; then
    echo "usage: triton-epd-seed SEED_DIR SECRETS_DIR KEYS_DIR" >&2
    exit 2
fi
app=${TRITON_EPD_APP:-/opt/triton-epd}
seed=$1 secrets=$2 keys=$3
for dir in model_repository build; do
    cp -a "$app/$dir/." "$seed/$dir/"
done
# The Secret's keys are symlinks into its ..data folder, which the glob skips.
for file in "$secrets"/*; do
    [ -f "$file" ] || continue
    install -m 0400 "$file" "$keys/$(basename "$file")"
    echo "triton-epd-seed: $keys/$(basename "$file")"
done
