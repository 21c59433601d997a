#!/usr/bin/env bash
set -euo pipefail
echo "e2e: not implemented yet" >&2
exit 1
