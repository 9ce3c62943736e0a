#!/usr/bin/env bash
# End-to-end test on a kind cluster: create it, build and load both images, install the chart,
# run the suite in lib.sh (example Ready, /generate + OpenAI requests, metrics, scaling,
# cleanup), delete the cluster.
#   MODE=cpu tests/e2e/kind.sh     # default: no GPUs needed
#   MODE=gpu tests/e2e/kind.sh     # real GPUs: needs nvkind and the NVIDIA container toolkit
# See lib.sh for the other settings.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CLUSTER="${CLUSTER:-multiguess-e2e}"

prepare_tools
need kind
private_kubeconfig

CLUSTER_DESCRIPTION="kind cluster $CLUSTER"
delete_cluster() { kind delete cluster --name "$CLUSTER" || true; }
trap finish EXIT

log "creating kind cluster $CLUSTER ($MODE mode)"
if [[ "$MODE" == gpu ]]; then
  need nvkind
  nvkind cluster create --name "$CLUSTER"
  kind get kubeconfig --name "$CLUSTER" >"$KUBECONFIG"
else
  kind create cluster --name "$CLUSTER" --wait 180s ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"}
fi

build_images
log "loading images into kind"
kind load docker-image "$SERVER_IMAGE" "$OPERATOR_IMAGE" --name "$CLUSTER"
run_suite
