#!/usr/bin/env bash
# Create .venv with everything the project needs (idempotent; reuses an existing .venv when its requirements
# are unchanged). Usage: source-free, run it: bash scripts/setup-env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing requirements.txt into .venv (torch 2.13.0 CPU, triton, kernels, transformers, ...)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.txt
  echo "$want" > "$stamp"
fi
# nix-instantiate parses flake.nix in the tests (Debian's nix-bin)
if ! command -v nix-instantiate >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[setup] installing nix-bin (nix-instantiate) from Debian"
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nix-bin >/dev/null
fi
# nvcc builds the compiled CUDA variant in the tests; it is not installable from the registries here.
command -v nvcc >/dev/null 2>&1 || echo "[setup] warning: nvcc not found: the compiled-variant build tests will skip"
