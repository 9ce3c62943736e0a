#!/usr/bin/env bash
# What the image scripts need from Debian, installed where missing: the Docker engine (docker.io)
# and debootstrap (the base image's root filesystem). Installs only as root with apt-get; elsewhere
# it names what to install and fails.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
[[ ${#missing[@]} -eq 0 ]] && exit 0
if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
  die "install ${missing[*]} (as root: apt-get install ${missing[*]})"
fi
log "installing ${missing[*]} from Debian's packages"
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
