#!/usr/bin/env bash
# Every wheel the two images install, downloaded once into $MULTIGUESS_IMAGE_CACHE/wheels: torch's
# CPU build (never a CUDA one), the project's server and operator dependencies, the embedded
# target's package, and the build backend. build.sh serves this folder to `docker build` so the
# images build without any index. Warm (same pyproject.toml, torch and embedded versions): a no-op.
#
# The CPU torch wheel comes from wherever this machine's pip finds `torch==VERSION+cpu`: a local
# find-links folder, or PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PYTHON="${PYTHON:-$REPO_ROOT/.venv/bin/python}"
WHEELS="$CACHE/wheels"
KEY="$(cat "$REPO_ROOT/pyproject.toml" "$0" <(echo "$TORCH_VERSION $SMOLLM_VERSION") | sha256sum | cut -c1-12)"
STAMP="$WHEELS/.complete-$KEY"

if [[ -e "$STAMP" ]]; then
  log "wheelhouse $WHEELS is complete for this pyproject.toml"
  exit 0
fi
[[ -x "$PYTHON" ]] || die "$PYTHON not found: run 'make setup' first"
mkdir -p "$WHEELS"
pip_download() { "$PYTHON" -m pip download --quiet --dest "$WHEELS" --find-links "$WHEELS" "$@"; }
log "downloading torch==$TORCH_VERSION+cpu into $WHEELS"
pip_download --no-deps "torch==$TORCH_VERSION+cpu" \
  || die "no CPU torch wheel found: set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu or PIP_FIND_LINKS to a folder holding it"
log "downloading the server's and the operator's dependencies"
pip_download "${REPO_ROOT}[server,operator]" "setuptools>=68" wheel
pip_download --no-deps "$SMOLLM_VERSION"
rm -f "$WHEELS"/multiguess-*
# The CPU build is the only torch and nothing may pull CUDA libraries in; every file is a wheel,
# so the builds never compile a dependency.
if compgen -G "$WHEELS/nvidia_*" >/dev/null || compgen -G "$WHEELS/triton-*" >/dev/null; then
  die "CUDA wheels landed in $WHEELS: torch's CPU build was not the one resolved"
fi
if find "$WHEELS" -maxdepth 1 -type f ! -name '*.whl' ! -name '.complete-*' | grep -q .; then
  die "not every dependency is a wheel: $(find "$WHEELS" -maxdepth 1 -type f ! -name '*.whl' ! -name '.complete-*')"
fi
rm -f "$WHEELS"/.complete-*
touch "$STAMP"
log "wheelhouse: $(find "$WHEELS" -name '*.whl' | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1)"
