#!/usr/bin/env bash
# End-to-end test on minikube (docker driver): the same suite as kind.sh (see lib.sh).
#   MODE=cpu tests/e2e/minikube.sh     # default: no GPUs needed
#   MODE=gpu tests/e2e/minikube.sh     # real GPUs: `minikube start --gpus all` (NVIDIA toolkit)
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PROFILE="${PROFILE:-multiguess-e2e}"

prepare_tools
need minikube
private_kubeconfig

CLUSTER_DESCRIPTION="minikube profile $PROFILE"
delete_cluster() { minikube delete --profile "$PROFILE" || true; }
trap finish EXIT

log "starting minikube profile $PROFILE ($MODE mode)"
start=(start --profile "$PROFILE" --driver docker --cpus "${MINIKUBE_CPUS:-4}" --memory "${MINIKUBE_MEMORY:-8g}")
if [[ "$MODE" == gpu ]]; then
  start+=(--container-runtime docker --gpus all)
fi
minikube "${start[@]}"

build_images
log "loading images into minikube"
minikube --profile "$PROFILE" image load "$SERVER_IMAGE"
minikube --profile "$PROFILE" image load "$OPERATOR_IMAGE"
run_suite
