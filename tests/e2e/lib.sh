# Shared steps of the end-to-end tests; sourced by kind.sh and minikube.sh, which create the
# cluster, load the images and then call run_suite. Settings (environment variables):
#   MODE=cpu|gpu      cpu (default): no GPUs, the nodes get a fake nvidia.com/gpu resource and
#                     product label so the operator's real GPU pinning schedules onto them;
#                     gpu: real GPUs through the NVIDIA device plugin.
#   KEEP_CLUSTER=1    leave the cluster running afterwards (for debugging).
#   E2E_TIMEOUT=900s  how long to wait for rollouts and readiness.
#   GPU_PRODUCT       gpu mode only: the nvidia.com/gpu.product value when no node has the label.
#   TORCH_INDEX_URL   gpu mode only: the CUDA torch index for the serving image.
# shellcheck shell=bash
set -euo pipefail

E2E_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$E2E_DIR/../.." && pwd)"
MODE="${MODE:-cpu}"
NAMESPACE="${NAMESPACE:-multiguess-e2e}"
RELEASE="${RELEASE:-mg}"
EXAMPLE=e2e
SERVER_IMAGE=multiguess-server:e2e
OPERATOR_IMAGE=multiguess-operator:e2e
FAKE_GPU_PRODUCT=NVIDIA-A100-SXM4-40GB
TIMEOUT="${E2E_TIMEOUT:-900s}"
PYTHON="${PYTHON:-$REPO_ROOT/.venv/bin/python}"
HELM="$REPO_ROOT/.tools/bin/helm"
PORT_FORWARD_PID=""
PINNED_PRODUCT=""  # the nvidia.com/gpu.product the example's pods must be pinned to

log() { printf '\n=== [e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf '\ne2e FAILED: %s\n' "$*" >&2; exit 1; }
need() { command -v "$1" >/dev/null 2>&1 || die "$1 is not installed (needed for this test)"; }

# kubectl and helm come from .tools/bin (scripts/install_tools.py) unless already on PATH.
prepare_tools() {
  case "$MODE" in cpu | gpu) ;; *) die "MODE must be cpu or gpu, not '$MODE'" ;; esac
  need docker
  docker info >/dev/null 2>&1 || die "no Docker engine answers (docker info failed)"
  [[ -x "$PYTHON" ]] || die "$PYTHON not found: run 'make setup' first"
  if [[ ! -x "$HELM" ]]; then
    "$PYTHON" "$REPO_ROOT/scripts/install_tools.py" --no-checkov
  fi
  export PATH="$REPO_ROOT/.tools/bin:$PATH"
  need kubectl
  need helm
}

# A kubeconfig of our own: the user's contexts are never touched.
private_kubeconfig() {
  KUBECONFIG_DIR="$(mktemp -d -t multiguess-e2e.XXXXXX)"
  export KUBECONFIG="$KUBECONFIG_DIR/kubeconfig"
}

build_images() {
  local torch_index=https://download.pytorch.org/whl/cpu
  if [[ "$MODE" == gpu ]]; then
    torch_index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}"
  fi
  log "building $SERVER_IMAGE (torch from $torch_index) and $OPERATOR_IMAGE"
  docker build --target server --build-arg TORCH_INDEX_URL="$torch_index" -t "$SERVER_IMAGE" "$REPO_ROOT"
  docker build --target operator -t "$OPERATOR_IMAGE" "$REPO_ROOT"
}

# CPU mode: every node claims four A100s. The label satisfies the operator's nodeSelector and the
# status patch advertises nvidia.com/gpu as an extended resource (the documented way to add one
# by hand), so the pods' GPU limits schedule. Nothing is injected into the containers: they run
# on CPU, unchanged.
fake_gpus() {
  local node
  for node in $(kubectl get nodes -o name); do
    log "faking 4 x $FAKE_GPU_PRODUCT on $node"
    kubectl label --overwrite "$node" "nvidia.com/gpu.product=$FAKE_GPU_PRODUCT"
    kubectl patch "$node" --subresource=status --type=json \
      -p '[{"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": "4"}]'
    kubectl wait "$node" --for=jsonpath='{.status.allocatable.nvidia\.com/gpu}'=4 --timeout=60s
  done
  PINNED_PRODUCT="$FAKE_GPU_PRODUCT"
}

# GPU mode: the NVIDIA device plugin (with GPU feature discovery for the product label) must
# advertise nvidia.com/gpu; nodes without a product label get GPU_PRODUCT or nvidia-smi's name.
real_gpus() {
  if ! kubectl get nodes -o jsonpath='{.items[*].status.allocatable.nvidia\.com/gpu}' | grep -q '[1-9]'; then
    log "installing the NVIDIA device plugin with GPU feature discovery"
    helm upgrade --install nvidia-device-plugin nvidia-device-plugin \
      --repo https://nvidia.github.io/k8s-device-plugin --version 0.17.1 \
      --namespace nvidia-device-plugin --create-namespace --set gfd.enabled=true --wait --timeout 10m
    local tries=0
    until kubectl get nodes -o jsonpath='{.items[*].status.allocatable.nvidia\.com/gpu}' | grep -q '[1-9]'; do
      (( ++tries < 60 )) || die "no node advertises nvidia.com/gpu after installing the device plugin"
      sleep 5
    done
  fi
  local product node
  product="$(kubectl get nodes -o jsonpath='{.items[*].metadata.labels.nvidia\.com/gpu\.product}' | awk '{print $1}')"
  if [[ -z "$product" ]]; then
    product="${GPU_PRODUCT:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | tr ' ' '-')}"
    [[ -n "$product" ]] || die "set GPU_PRODUCT: no node has nvidia.com/gpu.product and nvidia-smi is unavailable"
    for node in $(kubectl get nodes -o name); do
      kubectl label --overwrite "$node" "nvidia.com/gpu.product=$product"
    done
  fi
  PINNED_PRODUCT="$product"
  log "serving on real GPUs: $PINNED_PRODUCT"
}

install_chart() {
  local extra=()
  if [[ "$MODE" == gpu ]]; then
    extra=(-f "$E2E_DIR/values-gpu.yaml" --set-string "example.spec.target.gpu.product=$PINNED_PRODUCT")
  fi
  log "installing the chart (operator + CRD + example '$EXAMPLE')"
  helm upgrade --install "$RELEASE" "$REPO_ROOT/charts/multiguess" --namespace "$NAMESPACE" --create-namespace \
    -f "$E2E_DIR/values.yaml" "${extra[@]}" --wait --timeout 10m
  kubectl get crd speculativedeployments.multiguess.io -o name
}

# The real API server checks the examples against the CRD, CEL rules included.
validate_examples() {
  log "server-side validation of examples/ and of an invalid resource"
  kubectl apply --dry-run=server -n "$NAMESPACE" \
    -f "$REPO_ROOT/examples/speculative.yaml" -f "$REPO_ROOT/examples/separate-draft.yaml"
  local out
  if out="$(kubectl apply --dry-run=server -n "$NAMESPACE" -f - 2>&1 <<'EOF'
apiVersion: multiguess.io/v1alpha1
kind: SpeculativeDeployment
metadata: {name: invalid}
spec:
  target: {model: m, gpu: {product: NVIDIA-A100-SXM4-40GB}}
  speculation: {drafter: none}
  autoscaling: {minReplicas: 5, maxReplicas: 2}
EOF
  )"; then
    die "the API server accepted minReplicas > maxReplicas"
  fi
  grep -q "minReplicas must not exceed" <<<"$out" || die "unexpected rejection: $out"
}

wait_ready() {
  log "waiting for SpeculativeDeployment/$EXAMPLE to be Ready"
  kubectl -n "$NAMESPACE" wait "specdeploy/$EXAMPLE" --for=condition=Ready --timeout="$TIMEOUT"
  kubectl -n "$NAMESPACE" get specdeploy,deployments,pods,services -o wide
  local pinned
  pinned="$(kubectl -n "$NAMESPACE" get "deployment/$EXAMPLE-target" \
    -o jsonpath='{.spec.template.spec.nodeSelector.nvidia\.com/gpu\.product}')"
  [[ "$pinned" == "$PINNED_PRODUCT" ]] || die "target pods pinned to '$pinned', not '$PINNED_PRODUCT'"
}

port_forward() {
  log "port-forwarding svc/$EXAMPLE to 127.0.0.1:18000"
  kubectl -n "$NAMESPACE" port-forward "svc/$EXAMPLE" 18000:8000 >/dev/null 2>&1 &
  PORT_FORWARD_PID=$!
}

stop_port_forward() {
  if [[ -n "$PORT_FORWARD_PID" ]]; then
    kill "$PORT_FORWARD_PID" 2>/dev/null || true
    wait "$PORT_FORWARD_PID" 2>/dev/null || true
    PORT_FORWARD_PID=""
  fi
}

check_api() {
  log "/generate, OpenAI completions and chat (streaming too), /metrics"
  "$PYTHON" "$E2E_DIR/check_api.py" http://127.0.0.1:18000
}

# `kubectl scale` goes through the CRD's scale subresource; the operator rolls it out.
check_manual_scale() {
  log "kubectl scale specdeploy/$EXAMPLE --replicas=2"
  kubectl -n "$NAMESPACE" scale "specdeploy/$EXAMPLE" --replicas=2
  kubectl -n "$NAMESPACE" wait "deployment/$EXAMPLE-target" --for=jsonpath='{.status.readyReplicas}'=2 --timeout="$TIMEOUT"
  kubectl -n "$NAMESPACE" wait "specdeploy/$EXAMPLE" --for=jsonpath='{.status.replicas}'=2 --timeout=120s
  kubectl -n "$NAMESPACE" scale "specdeploy/$EXAMPLE" --replicas=1
  kubectl -n "$NAMESPACE" wait "deployment/$EXAMPLE-target" --for=jsonpath='{.spec.replicas}'=1 --timeout=120s
}

# The autoscaler: a tiny queue-latency target and sustained load must raise spec.replicas. The
# server decodes at most 2 sequences at once (values.yaml), so 12 clients keep a queue.
check_autoscale() {
  log "autoscaling on queue latency under load"
  stop_port_forward
  port_forward
  kubectl -n "$NAMESPACE" patch "specdeploy/$EXAMPLE" --type=merge -p '{"spec": {"autoscaling": {
    "enabled": true, "minReplicas": 1, "maxReplicas": 2, "metric": "queueLatencyP95",
    "targetQueueLatencySeconds": 0.05, "intervalSeconds": 5, "scaleDownStabilizationSeconds": 30}}}'
  "$PYTHON" "$E2E_DIR/check_api.py" http://127.0.0.1:18000 --load-seconds 120 --concurrency 12 &
  local load_pid=$!
  kubectl -n "$NAMESPACE" wait "specdeploy/$EXAMPLE" --for=jsonpath='{.spec.replicas}'=2 --timeout=300s
  wait "$load_pid"
  kubectl -n "$NAMESPACE" get "specdeploy/$EXAMPLE" -o jsonpath='{.status.autoscaling}{"\n"}'
  kubectl -n "$NAMESPACE" get events --field-selector "involvedObject.name=$EXAMPLE" \
    | grep ScaledUp || die "no ScaledUp event was recorded for $EXAMPLE"
}

# The resource goes first, while the operator still runs to release its finalizer (docs/DEPLOY.md).
delete_and_uninstall() {
  log "deleting specdeploy/$EXAMPLE: its children must go"
  kubectl -n "$NAMESPACE" delete "specdeploy/$EXAMPLE" --wait --timeout=300s
  local kind
  for kind in deployment service poddisruptionbudget; do
    kubectl -n "$NAMESPACE" wait "$kind" -l "app.kubernetes.io/instance=$EXAMPLE" --for=delete --timeout=300s || true
    if [[ -n "$(kubectl -n "$NAMESPACE" get "$kind" -l "app.kubernetes.io/instance=$EXAMPLE" -o name)" ]]; then
      die "$kind objects of $EXAMPLE outlived their SpeculativeDeployment"
    fi
  done
  log "helm uninstall"
  helm uninstall "$RELEASE" --namespace "$NAMESPACE" --wait --timeout 5m
}

diagnostics() {
  log "diagnostics"
  kubectl get nodes -o wide || true
  kubectl -n "$NAMESPACE" get all,specdeploy,events -o wide || true
  kubectl -n "$NAMESPACE" describe "specdeploy/$EXAMPLE" || true
  kubectl -n "$NAMESPACE" logs "deployment/$RELEASE-multiguess" --tail=200 || true
  kubectl -n "$NAMESPACE" logs "deployment/$EXAMPLE-target" --tail=200 || true
}

run_suite() {
  if [[ "$MODE" == cpu ]]; then fake_gpus; else real_gpus; fi
  install_chart
  validate_examples
  wait_ready
  port_forward
  check_api
  check_manual_scale
  check_autoscale
  stop_port_forward
  delete_and_uninstall
  log "PASSED ($MODE mode)"
}

# EXIT trap of both cluster scripts: diagnostics on failure, then the cluster goes unless
# KEEP_CLUSTER=1. Each script sets CLUSTER_DESCRIPTION and defines delete_cluster.
finish() {
  local status=$?
  stop_port_forward
  if (( status != 0 )); then diagnostics; fi
  if [[ "${KEEP_CLUSTER:-0}" == 1 ]]; then
    log "keeping $CLUSTER_DESCRIPTION (KUBECONFIG=$KUBECONFIG)"
  else
    delete_cluster
    rm -rf "$KUBECONFIG_DIR"
  fi
  exit "$status"
}
