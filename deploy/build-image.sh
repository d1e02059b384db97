#!/usr/bin/env bash
# Builds a runnable autohedge image from a locally built binary, with no registry: the binary, the
# shared libraries `ldd` lists, CA certificates and a passwd entry for a non-root user, on
# `FROM scratch`. Same entrypoint, user and HEALTHCHECK as the Dockerfile.
#
# Usage: deploy/build-image.sh [BINARY] [TAG]
#   BINARY defaults to target/release/autohedge (built if missing), TAG to autohedge:local.
#   For the binary the Dockerfile ships: cargo build --profile dist, then pass target/dist/autohedge.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${1:-target/release/autohedge}"
tag="${2:-autohedge:local}"
if [ ! -x "$bin" ]; then
  cargo build --release --locked --bin autohedge
fi
ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/usr/local/bin" "$ctx/etc/ssl/certs" "$ctx/etc/autohedge" "$ctx/tmp" "$ctx/home/nonroot/data"
cp "$bin" "$ctx/usr/local/bin/autohedge"
# The dynamic loader and every library the binary links, at their own paths.
for lib in $(ldd "$bin" | grep -oE '/[^ ]+'); do
  mkdir -p "$ctx$(dirname "$lib")"
  cp -L "$lib" "$ctx$lib"
done
[ -f /etc/ssl/certs/ca-certificates.crt ] && cp /etc/ssl/certs/ca-certificates.crt "$ctx/etc/ssl/certs/"
cp config/config.yaml "$ctx/etc/autohedge/config.yaml"
printf 'root:x:0:0::/root:/sbin/nologin\nnonroot:x:65532:65532::/home/nonroot:/sbin/nologin\n' > "$ctx/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' > "$ctx/etc/group"
chmod 1777 "$ctx/tmp"
cat > "$ctx/Dockerfile" <<'DOCKERFILE'
FROM scratch
COPY . /
# COPY drops ownership; the data directory must belong to the non-root user.
COPY --chown=65532:65532 home/nonroot /home/nonroot
USER 65532:65532
WORKDIR /home/nonroot
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["/usr/local/bin/autohedge", "healthcheck", "--url", "http://127.0.0.1:8000"]
ENTRYPOINT ["/usr/local/bin/autohedge"]
CMD ["serve", "--config", "/etc/autohedge/config.yaml", "--listen", "0.0.0.0:8000", "--data-dir", "/home/nonroot/data"]
DOCKERFILE
docker build -q -t "$tag" "$ctx" >/dev/null
echo "$tag"
