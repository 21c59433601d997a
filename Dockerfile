# Equivalent of `make image` for users with Docker (or podman/buildah):
#   docker build -t ghcr.io/ambientd/ambientd:dev .
# `make image` (hack/image.sh) builds the same contents without a container
# engine and reproducibly: Debian bookworm's iptables, nftables and ipset with
# their libraries, and both binaries in /usr/local/bin. This Dockerfile's
# digest differs (package manager state, timestamps); its files do not.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -buildvcs=false -tags grpcnotrace -ldflags='-s -w' -o /out/ambientd ./cmd/ambientd && \
    CGO_ENABLED=0 go build -trimpath -buildvcs=false -tags grpcnotrace -ldflags='-s -w' -o /out/ambientd-cni ./cmd/ambientd-cni

FROM debian:bookworm-slim
RUN apt-get update && \
    apt-get install -y --no-install-recommends iptables nftables ipset && \
    rm -rf /var/lib/apt/lists/* /usr/share/doc /usr/share/man /usr/share/locale
COPY --from=build /out/ambientd /out/ambientd-cni /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/ambientd"]
CMD ["run"]
