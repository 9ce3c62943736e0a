#!/usr/bin/env bash
# `make e2e-images`: build both images here (build.sh) and run them (tests/e2e/image_checks.py):
# the serving image answers the README's requests and the OpenAI client under the pod's
# restrictions, the operator image reconciles examples/speculative.yaml against kmock's emulator.
# Installs docker.io and debootstrap where missing (prerequisites.sh), starts a private Docker
# engine when none answers, and stops it again afterwards.
# COLD=1 first empties the cache (base filesystem, wheelhouse, layer cache): the cold path.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

"$IMAGES_DIR/prerequisites.sh"
PYTHON="${PYTHON:-$REPO_ROOT/.venv/bin/python}"
export PYTHON
started=$(date +%s)
had_engine=0
[[ -s "$ENGINE_RUN/dockerd.pid" ]] && had_engine=1
if [[ "${COLD:-0}" == 1 ]]; then
  "$IMAGES_DIR/engine.sh" stop
  had_engine=0
  log "COLD=1: emptying $CACHE"
  rm -rf "$CACHE"
fi
DOCKER_HOST="$("$IMAGES_DIR/engine.sh" start)"
export DOCKER_HOST
if [[ "$had_engine" == 0 && -s "$ENGINE_RUN/dockerd.pid" ]]; then
  trap '"$IMAGES_DIR/engine.sh" stop' EXIT
fi

"$IMAGES_DIR/build.sh"
built=$(date +%s)
cd "$REPO_ROOT"
export PYTHONPATH="$REPO_ROOT/server:$REPO_ROOT/operator:$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -m tests.e2e.image_checks server "$SERVER_IMAGE"
"$PYTHON" -m tests.e2e.image_checks operator "$OPERATOR_IMAGE" "$SERVER_IMAGE"
log "images e2e passed: build $((built - started)) s, checks $(($(date +%s) - built)) s"
