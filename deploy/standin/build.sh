#!/usr/bin/env bash
# Stand-ins for the base images compose.yaml and the Dockerfile name, built from Debian packages where no
# image registry can be reached: one Debian 12 root filesystem (debootstrap, `docker import`ed as
# metrale/debian-base), then one small `docker build` per stand-in on top of it (apt inside the build):
#
#   python:3.11-slim   Debian's python3.11 + pip (PEP 668's marker removed: the image is the environment)
#   redis:7.4          Debian's redis-server 7.0 (the commands compose.yaml uses exist in both)
#   nginx:1.28-alpine  Debian's nginx 1.22 + wget (deploy/nginx.conf keeps to what 1.22 has)
#
# The host's CA bundle goes into the base, so pip and apt inside reach the registries through whatever
# TLS interception the host trusts. Each tag that exists already is kept (a cache between runs):
# `docker rmi` it to rebuild. Usage: deploy/standin/build.sh (as root, with dockerd running).
set -euo pipefail
cd "$(dirname "$0")"
say() { echo "standin: $*" >&2; }

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE=metrale/debian-base:bookworm

have() { docker image inspect "$1" >/dev/null 2>&1; }

if ! have "$BASE"; then
  root=$(mktemp -d /var/tmp/metrale-rootfs.XXXXXX)
  # debootstrap mounts /proc (and /sys) inside while it runs: unmount before removing, never cross mounts.
  trap 'umount -R "$root/proc" "$root/sys" 2>/dev/null || true; rm -rf --one-file-system "$root" "$root.log"' EXIT
  say "debootstrap bookworm (minbase) into $root ..."
  debootstrap --variant=minbase --include=ca-certificates bookworm "$root" "$MIRROR" >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
  rm -f "$root.log"
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\n' "$MIRROR" "$MIRROR" > "$root/etc/apt/sources.list"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" --one-file-system -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    --change 'CMD ["bash"]' - "$BASE" >/dev/null
  say "imported $BASE"
fi

build() {  # build TAG DOCKERFILE
  if have "$1"; then
    say "$1: cached"
    return
  fi
  say "building $1 from $2 ..."
  docker build -q -t "$1" -f "$2" . >/dev/null 2>"/tmp/metrale-standin-build.log" || { tail -30 /tmp/metrale-standin-build.log >&2; exit 1; }
}

build python:3.11-slim python.Dockerfile
build redis:7.4 redis.Dockerfile
build nginx:1.28-alpine nginx.Dockerfile
