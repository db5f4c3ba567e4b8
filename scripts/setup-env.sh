#!/usr/bin/env bash
# Create .venv with everything the project needs and kerneltools installed editable from this checkout (the
# `kerneltools` command; `import kerneltools` from any directory). Idempotent: an existing venv is reused, the
# requirements are installed again only when requirements.txt changes, kerneltools only when pyproject.toml or
# the checkout's path changes or the venv imports another checkout's kerneltools.
# Usage: bash scripts/setup-env.sh   (PYTHON=python3.11 picks the interpreter, VENV=DIR another venv folder)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing requirements.txt into $VENV (torch 2.13.0 CPU, triton, kernels, transformers, ...)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -r requirements.txt
  echo "$want" > "$stamp"
fi
# kerneltools, editable: pyproject.toml's packages and console script, this checkout's sources
project_stamp=$VENV/.kerneltools.sha256
project_want=$( (cat pyproject.toml; pwd) | sha256sum | cut -d' ' -f1)
installed_here() {
  [ -x "$VENV/bin/kerneltools" ] && "$VENV/bin/python" -I -c 'import pathlib, sys, kerneltools
sys.exit(pathlib.Path(kerneltools.__file__).resolve().parent != pathlib.Path(sys.argv[1]).resolve())' \
    "$PWD/kerneltools" 2>/dev/null
}
if [ "$(cat "$project_stamp" 2>/dev/null)" != "$project_want" ] || ! installed_here; then
  echo "[setup] installing kerneltools (editable, from $PWD) into $VENV"
  # no build isolation: requirements.txt pins setuptools; its warning about editable installs is expected
  PYTHONWARNINGS="ignore::UserWarning" "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e .
  installed_here || { echo "[setup] error: $VENV does not import kerneltools from $PWD after the install" >&2; exit 1; }
  echo "$project_want" > "$project_stamp"
fi
# nix-instantiate parses flake.nix in the tests (Debian's nix-bin)
if ! command -v nix-instantiate >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[setup] installing nix-bin (nix-instantiate) from Debian"
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nix-bin >/dev/null
fi
# nvcc builds the compiled CUDA variant in the tests; it is not installable from the registries here.
command -v nvcc >/dev/null 2>&1 || echo "[setup] warning: nvcc not found: the compiled-variant build tests will skip"
