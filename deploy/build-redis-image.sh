#!/usr/bin/env bash
# Builds a Redis 7 image from this machine's own `redis-server` and `redis-cli` (Debian's
# packages), with no registry, as deploy/build-image.sh builds the gateway's: the binaries and
# the shared libraries `ldd` lists, on `FROM scratch`. It runs what Docker Hub's `redis:7` runs:
# docker-compose.yml's `command: ["redis-server", ...]` and its `redis-cli ping` health check work
# on either. With no command: persistence off, listening on 6379 on every interface of its
# network (the tests' own overlay networks only).
#
# Usage: deploy/build-redis-image.sh [TAG]   (TAG defaults to autohedge-redis:local)
set -euo pipefail
tag="${1:-autohedge-redis:local}"
bin="$(command -v redis-server || true)"
cli="$(command -v redis-cli || true)"
if [ -z "$bin" ] || [ -z "$cli" ]; then
  echo "redis-server is not installed (apt-get install redis-server; tests/run-all.sh does)" >&2
  exit 1
fi
ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT
# The binary keeps the name redis-server: Debian ships it as a link to redis-check-rdb, and Redis
# picks its mode from the name it was started by.
mkdir -p "$ctx/usr/local/bin" "$ctx/data" "$ctx/tmp"
cp -L "$bin" "$ctx/usr/local/bin/redis-server"
cp -L "$cli" "$ctx/usr/local/bin/redis-cli"
for lib in $( (ldd "$bin"; ldd "$cli") | grep -oE '/[^ ]+' | sort -u); do
  mkdir -p "$ctx$(dirname "$lib")"
  cp -L "$lib" "$ctx$lib"
done
chmod 1777 "$ctx/tmp"
cat > "$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY . /
ENV PATH=/usr/local/bin
WORKDIR /data
EXPOSE 6379
CMD ["redis-server", "--port", "6379", "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "no"]
DOCKERFILE
docker build -q -t "$tag" "$ctx" >/dev/null
echo "$tag"
