#!/usr/bin/env bash
# Both images, built where no image registry or PyTorch index answers: the debootstrap base
# (base_image.sh) as BASE_IMAGE and the wheelhouse (wheelhouse.sh) served on 127.0.0.1 to pip.
# Builds use the host's network (`--network host`), the only one the private engine has.
#   SERVER_IMAGE, OPERATOR_IMAGE   the tags (default multiguess-server:local, multiguess-operator:local)
#   WHEELHOUSE_PORT                where the wheelhouse is served (default 18099); it is part of
#                                  the build's cache key, so keep it fixed between builds
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PYTHON="${PYTHON:-$REPO_ROOT/.venv/bin/python}"
PORT="${WHEELHOUSE_PORT:-18099}"

base="$("$IMAGES_DIR/base_image.sh")"
"$IMAGES_DIR/wheelhouse.sh"
"$PYTHON" -m http.server --bind 127.0.0.1 --directory "$CACHE/wheels" "$PORT" >/dev/null 2>&1 &
server_pid=$!
trap 'kill "$server_pid" 2>/dev/null || true' EXIT
for _ in $(seq 50); do
  curl -sf "http://127.0.0.1:$PORT/" >/dev/null && break
  kill -0 "$server_pid" 2>/dev/null || die "the wheelhouse server could not listen on 127.0.0.1:$PORT"
  sleep 0.1
done

build() {
  local target="$1" tag="$2" started
  started=$(date +%s)
  log "docker build --target $target -t $tag (base $base)"
  "$DOCKER" build --network host --target "$target" --tag "$tag" \
    --build-arg BASE_IMAGE="$base" \
    --build-arg PIP_FIND_LINKS="http://127.0.0.1:$PORT/" --build-arg PIP_NO_INDEX=1 \
    "$REPO_ROOT" >&2
  log "built $tag in $(($(date +%s) - started)) s: $("$DOCKER" image inspect --format '{{.Size}}' "$tag" | numfmt --to=iec)"
}

build server "$SERVER_IMAGE"
build operator "$OPERATOR_IMAGE"
# The untagged images of earlier builds are the layer cache (the build stages' layers are never
# part of a tagged image), so they stay until the private engine's data root passes
# MULTIGUESS_IMAGE_CACHE_MAX_GB (default 20); then all of them go and the next build is cold.
used_gb=$(($(du -sk "$CACHE/docker" 2>/dev/null | cut -f1 || echo 0) / 1048576))
if ((used_gb > ${MULTIGUESS_IMAGE_CACHE_MAX_GB:-20})); then
  log "the layer cache holds ${used_gb} GB: dropping the untagged images"
  "$DOCKER" image prune --force >/dev/null
fi
