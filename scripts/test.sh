#!/usr/bin/env bash
# The whole test suite: set up if needed, lint, then pytest on real llama.cpp, redis-server and
# HTTP servers started by the tests themselves.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
"$VENV/bin/ruff" check python tests bench
"$VENV/bin/ruff" format --check python tests bench
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests "$@"
