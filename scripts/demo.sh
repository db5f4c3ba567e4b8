#!/usr/bin/env bash
# The main job: build -> serve the loopback Hub -> publish -> get_kernel -> kernelize a small Gemma model -> report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec .venv/bin/python -m kerneltools demo "$@"
