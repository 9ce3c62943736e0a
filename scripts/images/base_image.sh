#!/usr/bin/env bash
# A local base image for the Dockerfile's BASE_IMAGE, made from Debian's own packages where no
# image registry answers: debootstrap bookworm with Python 3.11, venv and pip, imported with
# `docker import`. Prints the image's name. The root filesystem tarball is cached under
# $MULTIGUESS_IMAGE_CACHE/base/, keyed by this script's recipe, so only the first run on a
# machine pays for debootstrap; an image already in the engine is reused as it is.
#
#   docker build --build-arg BASE_IMAGE="$(scripts/images/base_image.sh)" --target server .
#
# Needs root, debootstrap and a Debian mirror (DEBIAN_MIRROR, default deb.debian.org).
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES=python3.11,python3-venv,python3-pip,python-is-python3,ca-certificates
KEY="$(printf '%s\n' "$SUITE" "$MIRROR" "$PACKAGES" "$(sed -n '/^make_rootfs()/,/^}/p' "$0")" \
  | sha256sum | cut -c1-12)"
IMAGE="multiguess-base:$SUITE-python3.11-$KEY"
TARBALL="$CACHE/base/$SUITE-python3.11-$KEY.tar"

make_rootfs() {
  local root="$1"
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR" >&2
  cat >"$root/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian}/debian-security $SUITE-security main
SOURCES
  # What the slim Python images leave out too: package lists, caches, docs and man pages.
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* \
    "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/tmp/* "$root"/var/log/*.log
}

if "$DOCKER" image inspect "$IMAGE" >/dev/null 2>&1; then
  log "base image $IMAGE is in the engine already"
else
  if [[ ! -s "$TARBALL" ]]; then
    [[ "$(id -u)" == 0 ]] || die "debootstrap needs root"
    command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
    log "debootstrap $SUITE into a new root filesystem (the cold path: minutes)"
    mkdir -p "$CACHE/base"
    work="$(mktemp -d "$CACHE/base/rootfs.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
    make_rootfs "$work/root"
    tar --numeric-owner -C "$work/root" -cf "$TARBALL.part" .
    mv "$TARBALL.part" "$TARBALL"
  fi
  log "importing $TARBALL as $IMAGE"
  "$DOCKER" import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    "$TARBALL" "$IMAGE" >/dev/null
fi
echo "$IMAGE"
