#!/usr/bin/env bash
# The test suite (CPU: Triton kernels under the Triton interpreter; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup-env.sh
exec .venv/bin/python -m pytest -q "$@"
