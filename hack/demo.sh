#!/usr/bin/env bash
set -euo pipefail
echo "demo: not implemented yet" >&2
exit 1
