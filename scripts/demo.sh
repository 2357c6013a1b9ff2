#!/usr/bin/env bash
# The main job: set up if needed, then run the demo (prefill a long text in one process, save the
# context compressed to a local store, restore it in a second process and answer a question).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/setup.sh"
exec "$VENV/bin/llama-cachegen" demo "$@"
