"""Writes the golden containers of tests/test_bad_input.py (python tests/data/make_golden.py).

Once per container format version: `golden-v{version}-*`, which must decode to the same bytes
forever; older versions' containers are kept to check that they are refused clearly. With
`--encoder`, after a change of what the encoder writes within a version (a new quantizer rule):
`encoder-v{version}-*` of the lossy levels, what the encoder must keep writing exactly."""

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
    if sys.argv[1:] == ["--encoder"]:
        if level != "lossless":
            (HERE / f"encoder-v{version}-{level}.lcg").write_bytes(blob)
        continue
    (HERE / f"golden-v{version}-{level}.lcg").write_bytes(blob)
    (HERE / f"golden-v{version}-{level}.state").write_bytes(lcg.decode(blob))
