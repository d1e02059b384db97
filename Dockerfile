# syntax=docker/dockerfile:1
# Production image: multi-stage build, non-root user, exec-form entrypoint, and a HEALTHCHECK that
# runs the binary itself (no curl in the image).
#
# Where no registry can be reached (air-gapped hosts, CI sandboxes), build an equivalent image from
# a locally built binary instead: deploy/build-image.sh.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# `dist`: the release profile with fat LTO (Cargo.toml) — a longer build, a faster gateway.
RUN cargo build --profile dist --locked --bin autohedge \
 && strip target/dist/autohedge \
 && mkdir -p /out/data

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/dist/autohedge /usr/local/bin/autohedge
COPY config/config.yaml /etc/autohedge/config.yaml
# The audit database lives here; a named volume mounted on it inherits this ownership.
COPY --from=build --chown=65532:65532 /out/data /home/nonroot/data
USER 65532:65532
WORKDIR /home/nonroot
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["/usr/local/bin/autohedge", "healthcheck", "--url", "http://127.0.0.1:8000"]
ENTRYPOINT ["/usr/local/bin/autohedge"]
CMD ["serve", "--config", "/etc/autohedge/config.yaml", "--listen", "0.0.0.0:8000", "--data-dir", "/home/nonroot/data"]
