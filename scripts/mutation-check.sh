#!/usr/bin/env bash
# Plants representative bugs one at a time in a temporary copy and shows the CPU suite catching each
# (scripts/mutation_check.py; docs/development.md, "Mutation check"). A few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup-env.sh
exec .venv/bin/python scripts/mutation_check.py "$@"
