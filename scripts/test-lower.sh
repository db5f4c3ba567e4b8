#!/usr/bin/env bash
# The tests marked `ecosystem` (they touch kernels' or transformers' API) against the oldest supported pair,
# requirements-lower.txt (README, "Supported versions"). .venv-lower holds only those pins in its own site-packages
# and reads everything else (torch, triton, huggingface_hub, the editable kerneltools) from .venv, through a .pth
# file: creating it installs three packages, not torch. Idempotent like scripts/setup-env.sh.
# Usage: bash scripts/test-lower.sh [pytest args]   (LOWER_VENV=DIR another folder)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup-env.sh
LOWER=${LOWER_VENV:-.venv-lower}
upper_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
if [ ! -x "$LOWER/bin/python" ]; then
  echo "[lower] creating $LOWER over $upper_site"
  base=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')  # .venv's interpreter
  "$base" -m venv "$LOWER"
fi
lower_site=$("$LOWER/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
# after the venv's own site-packages: the pins below shadow .venv's kernels and transformers
echo "import site; site.addsitedir('$upper_site')" > "$lower_site/_geglu_upper_venv.pth"
stamp=$LOWER/.requirements.sha256
want=$( (cat requirements-lower.txt requirements.txt) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[lower] installing requirements-lower.txt into $LOWER"
  "$LOWER/bin/python" -m pip install -q -r requirements-lower.txt
  echo "$want" > "$stamp"
fi
"$LOWER/bin/python" -c 'import kernels, transformers; print(f"[lower] kernels {kernels.__version__}, transformers {transformers.__version__}")'
exec "$LOWER/bin/python" -m pytest -q -m ecosystem -p no:cacheprovider "$@"
