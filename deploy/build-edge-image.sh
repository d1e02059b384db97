#!/usr/bin/env bash
# Builds the stack's edge balancer image (`edge` in docker-compose.yml) from this machine's own
# HAProxy (Debian's `haproxy` package), with no registry, as deploy/build-image.sh builds the
# gateway's: the binary and the shared libraries `ldd` lists, on `FROM scratch`. It runs
# `haproxy -W -db -f /usr/local/etc/haproxy/haproxy.cfg`, the path and command of Docker Hub's
# `haproxy` image, so either image runs the stack's `deploy/edge.cfg` unchanged.
#
# Usage: deploy/build-edge-image.sh [TAG]   (TAG defaults to autohedge-edge:local)
set -euo pipefail
tag="${1:-autohedge-edge:local}"
bin="$(command -v haproxy || true)"
[ -z "$bin" ] && [ -x /usr/sbin/haproxy ] && bin=/usr/sbin/haproxy
if [ -z "$bin" ]; then
  echo "haproxy is not installed (apt-get install haproxy; tests/run-all.sh does)" >&2
  exit 1
fi
ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/usr/local/sbin" "$ctx/usr/local/etc/haproxy" "$ctx/etc" "$ctx/tmp" "$ctx/var/lib/haproxy"
cp -L "$bin" "$ctx/usr/local/sbin/haproxy"
for lib in $(ldd "$bin" | grep -oE '/[^ ]+'); do
  mkdir -p "$ctx$(dirname "$lib")"
  cp -L "$lib" "$ctx$lib"
done
printf 'root:x:0:0::/root:/sbin/nologin\nhaproxy:x:99:99::/var/lib/haproxy:/sbin/nologin\n' > "$ctx/etc/passwd"
printf 'root:x:0:\nhaproxy:x:99:\n' > "$ctx/etc/group"
chmod 1777 "$ctx/tmp"
cat > "$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY . /
ENV PATH=/usr/local/sbin:/usr/local/bin
USER 99:99
EXPOSE 8000
STOPSIGNAL SIGUSR1
CMD ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
DOCKERFILE
docker build -q -t "$tag" "$ctx" >/dev/null
echo "$tag"
