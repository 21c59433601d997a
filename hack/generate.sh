#!/usr/bin/env bash
# Regenerates the committed protobuf/gRPC Go code from every .proto in the repo.
# protoc comes from Debian (protobuf-compiler); the Go plugins are pinned as
# go.mod tools, so the output is the same on every machine.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
go build -o "$tools/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go
go build -o "$tools/protoc-gen-go-grpc" google.golang.org/grpc/cmd/protoc-gen-go-grpc
export PATH="$tools:$PATH"
for proto in $(git ls-files '*.proto'; find . -name '*.proto' -not -path './.cache/*' | sed 's|^\./||') ; do echo "$proto"; done | sort -u | while read -r proto; do
  dir=$(dirname "$proto")
  echo "generate: $proto"
  protoc -I "$dir" --go_out="$dir" --go_opt=paths=source_relative \
    --go-grpc_out="$dir" --go-grpc_opt=paths=source_relative "$proto"
done
