"""`bench/run.py --quick` writes a well-formed report and plots; it never asserts on speed."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

for _module in ("llama_cpp", "zstandard", "lz4", "matplotlib"):
    pytest.importorskip(_module)

ROOT = Path(__file__).resolve().parent.parent
RUN = [sys.executable, str(ROOT / "bench" / "run.py")]
LEVELS = ("lossless", "high", "balanced", "compact")
PNGS = ("rate_distortion.png", "ttft.png", "scaling.png")

Table = list[dict[str, str]]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([*RUN, "--quick", "--out", str(path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return path


def tables_by_section(markdown: str) -> dict[str, list[Table]]:
    """Every Markdown table under its nearest heading, rows as {header: cell}; checks their shape."""
    sections: dict[str, list[Table]] = {}
    heading, lines = "", markdown.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("#"):
            heading = lines[i].lstrip("#").strip()
        if lines[i].startswith("|"):
            block = []
            while i < len(lines) and lines[i].startswith("|"):
                block.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            header, separator, *rows = block
            assert all(set(c) == {"-"} for c in separator) and len(separator) == len(header), block[:2]
            for row in rows:
                assert len(row) == len(header), f"{heading}: {row} does not match {header}"
            sections.setdefault(heading, []).append([dict(zip(header, row, strict=True)) for row in rows])
            continue
        i += 1
    return sections


def section(tables: dict[str, list[Table]], prefix: str) -> list[Table]:
    found = [t for name, ts in tables.items() if name.startswith(prefix) for t in ts]
    assert found, f"no table under a heading starting with {prefix!r}; headings: {list(tables)}"
    return found


def number(cell: str) -> float:
    return float(cell)  # raises on anything that is not a plain number


def test_report_tables_are_complete_and_numeric(out: Path) -> None:
    tables = tables_by_section((out / "report.md").read_text(encoding="utf-8"))

    setup = {row["item"]: row["value"] for row in section(tables, "Setup")[0]}
    assert "--quick" in setup["command"] and setup["CPU"] and setup["llama-cpp-python"]

    presets, targets = section(tables, "Setup")[1], section(tables, "Targets")[0]
    assert [row["level"] for row in presets] == list(LEVELS)
    assert len(targets) == 8 and {row["result"] for row in targets} <= {"PASS", "FAIL"}

    for rd in section(tables, "96 tokens"):
        methods = {row["method"] for row in rd}
        assert {*LEVELS, "q8_0", "q5_1", "q4_0", "8-bit", "4-bit", "zstd", "lz4", "f16"} <= methods
        for row in rd:
            assert number(row["bits/element"]) > 0 and number(row["x smaller than f16"]) > 0
            assert number(row["KL"]) >= 0 and 0 <= number(row["top-1"]) <= 1
            number(row["Δppl"])

    speed = section(tables, "Codec speed")[0]
    assert {(row["method"], row["threads"]) for row in speed} >= {
        (lv, t) for lv in LEVELS for t in ("1", "2")
    }
    paths = {row["method"] for row in speed if "(" in row["method"]}  # decoder paths: decode only
    assert {f"{lv} ({path})" for lv in LEVELS for path in ("avx2 gather", "scalar")} <= paths
    for row in speed:
        assert number(row["decode MB/s"]) > 0
        assert row["method"].startswith("memcpy") or row["method"] in paths or number(row["encode MB/s"]) > 0

    ttft, break_even = section(tables, "Time to first token")
    assert [number(row["Gbps"]) for row in ttft] == [0.1, 0.5, 1, 3, 10, 25]
    assert all(number(v) > 0 for row in ttft for v in row.values())
    assert {f"fetch {lv}" for lv in LEVELS} <= {row["method"] for row in break_even}

    scaling = section(tables, "Scaling")[0]
    assert [int(row["tokens"]) for row in scaling] == [64, 128, 256]
    assert all(number(v) > 0 for row in scaling for v in row.values())

    assert len(section(tables, "Every point")[0]) >= 14


def test_plots_are_pngs(out: Path) -> None:
    for name in PNGS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", name
        width, height = struct.unpack(">II", data[16:24])
        assert width >= 300 and height >= 200, (name, width, height)


def test_results_json_matches_report(out: Path) -> None:
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert {"setup", "points", "speed", "ttft", "scaling"} <= set(results)
    assert len(results["points"]) == len(
        section(tables_by_section((out / "report.md").read_text()), "Every")[0]
    )


def test_fails_loudly_without_a_model(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*RUN, "--quick", "--model", str(tmp_path / "missing.gguf"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "model not found" in proc.stderr
    assert not (tmp_path / "report.md").exists()
