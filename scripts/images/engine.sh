#!/usr/bin/env bash
# A private Docker engine for the image scripts, where none answers already:
#   scripts/images/engine.sh start   # prints the DOCKER_HOST to use; reuses a running engine
#   scripts/images/engine.sh stop    # stops only an engine this script started
# The engine runs without a bridge or iptables rules (containers and builds use the host's
# network, so they reach only what the host reaches: 127.0.0.1 and the package registries),
# and keeps its data root (the layer cache) in $MULTIGUESS_IMAGE_CACHE/docker. Needs root.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PIDFILE="$ENGINE_RUN/dockerd.pid"

answers() { DOCKER_HOST="$1" "$DOCKER" info >/dev/null 2>&1; }

start() {
  if [[ -n "${DOCKER_HOST:-}" ]] && answers "$DOCKER_HOST"; then
    echo "$DOCKER_HOST"
    return
  fi
  if [[ -z "${DOCKER_HOST:-}" ]] && "$DOCKER" info >/dev/null 2>&1; then
    echo ""  # the default engine answers
    return
  fi
  [[ "$(id -u)" == 0 ]] || die "starting a Docker engine needs root"
  command -v dockerd >/dev/null || die "dockerd is not installed (apt-get install docker.io)"
  mkdir -p "$ENGINE_RUN" "$CACHE/docker"
  log "starting dockerd (data root $CACHE/docker, socket $ENGINE_RUN/docker.sock)"
  # The engine outlives this script: it must not keep the caller's descriptors open (a lock
  # held with flock, the pipe a test reads this script's output from).
  (
    for fd in /proc/"$BASHPID"/fd/*; do
      fd="${fd##*/}"
      if ((fd > 2)); then eval "exec $fd>&-"; fi
    done
    exec dockerd --host "$ENGINE_SOCKET" --data-root "$CACHE/docker" --exec-root "$ENGINE_RUN/exec" \
      --pidfile "$PIDFILE" --bridge=none --iptables=false --ip-masq=false --ip6tables=false \
      </dev/null >"$ENGINE_RUN/dockerd.log" 2>&1
  ) &
  for _ in $(seq 60); do
    if answers "$ENGINE_SOCKET"; then
      echo "$ENGINE_SOCKET"
      return
    fi
    sleep 1
  done
  tail -20 "$ENGINE_RUN/dockerd.log" >&2
  die "dockerd did not answer within 60 s (log: $ENGINE_RUN/dockerd.log)"
}

stop() {
  [[ -s "$PIDFILE" ]] || return 0
  local pid
  pid="$(cat "$PIDFILE")"
  log "stopping dockerd ($pid)"
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 30); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  rm -f "$PIDFILE"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) die "usage: engine.sh start|stop" ;;
esac
