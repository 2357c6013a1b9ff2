"""Writes the golden containers of tests/test_bad_input.py. Run once per container format version
(python tests/data/make_golden.py): the current version's files must decode and re-encode to the same
bytes forever; older versions' containers are kept to check that they are refused clearly."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

import llama_cachegen as lcg  # noqa: E402
from test_bad_input import GOLDEN_LEVELS, golden_container  # noqa: E402

version = lcg.version()[1]
for level in GOLDEN_LEVELS:
    blob = golden_container(level)
    (HERE / f"golden-v{version}-{level}.lcg").write_bytes(blob)
    (HERE / f"golden-v{version}-{level}.state").write_bytes(lcg.decode(blob))
