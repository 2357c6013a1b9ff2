"""KV layouts SmolLM2 and Gemma 3 do not have, on real llama.cpp with tiny GGUFs (tiny_models.py):
multi-head latent attention (DeepSeek-V2: K rows only, no V) and M-RoPE (Qwen2-VL: every cell
carries llama.cpp's 12-byte extension; Qwen's K bias). Every way a context travels gives back
exactly what llama.cpp computed, at the lossless level."""

from __future__ import annotations

from pathlib import Path

import llama_cachegen as lcg
import numpy as np
import pytest
from llama_cachegen import chunks, codec, stream
from llama_cachegen.cache import CompressedStateCache
from llama_cachegen.llama import capture_state, load_compressed_state, model_rope, save_compressed_state
from tiny_models import (
    LETTERS_ONLY,
    OTHER,
    TOKENS,
    C,
    N,
    continuation,
    make,
    reference_logits,
    write_deepseek2_mla,
    write_qwen2vl,
)

# (writer, K/V tensors per layer)
ARCHITECTURES = {"deepseek2-mla": (write_deepseek2_mla, 1), "qwen2vl-mrope": (write_qwen2vl, 2)}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    write, _ = ARCHITECTURES[request.param]
    return request.param, write(tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf")


@pytest.fixture(scope="module")
def reference(model: tuple[str, Path]) -> dict[str, np.ndarray]:
    return reference_logits(model[1])


@pytest.fixture(scope="module")
def source(model: tuple[str, Path]) -> lcg.Llama:
    llm = make(model[1])
    llm.eval(TOKENS)
    return llm


def test_the_layout_is_read(model: tuple[str, Path], source: lcg.Llama) -> None:
    name, _ = model
    info = codec.inspect_state(capture_state(source, None))
    per_layer = ARCHITECTURES[name][1]
    assert (info["tensors"], info["positions"], info["tail"]) == (2 * per_layer, (0, N), False)
    # neither rotates the first channels of each head by one position per token
    assert model_rope(source) is None


def test_whole_chunked_prefix_and_streamed_loads_are_exact(
    tmp_path: Path, model: tuple[str, Path], source: lcg.Llama, reference: dict[str, np.ndarray]
) -> None:
    path = model[1]
    save_compressed_state(source, tmp_path / "ctx.lcg", level="lossless")
    llm = make(path)
    load_compressed_state(llm, tmp_path / "ctx.lcg")
    np.testing.assert_array_equal(continuation(llm, N), reference["all"])

    url = f"file://{tmp_path}/store/ctx"
    chunks.save_chunked(source, url, levels=("lossless", "balanced"), chunk_tokens=C)
    llm = make(path)
    chunks.load_chunked(llm, url, level="lossless")
    np.testing.assert_array_equal(continuation(llm, N), reference["all"])
    llm = make(path)
    stream.load_streaming(llm, url, slo_s=5.0)  # generous: text or lossless, both exact
    np.testing.assert_array_equal(continuation(llm, N), reference["all"])

    llm = make(path)
    query = TOKENS[:200] + OTHER
    report = chunks.load_prefix(llm, f"file://{tmp_path}/store", query, chunk_tokens=C, level="lossless")
    assert report.tokens == 200 // C * C
    llm.eval(query[report.tokens :])
    np.testing.assert_array_equal(continuation(llm, len(query)), reference["other"])

    llm = make(path)  # lossy: it loads and runs (random weights say nothing of quality)
    chunks.load_chunked(llm, url, level="balanced")
    assert np.isfinite(continuation(llm, N)).all()


def test_the_prompt_cache_answers_as_llama_cpp_does(tmp_path: Path, model: tuple[str, Path]) -> None:
    path = model[1]
    texts, hits = [], []
    for cached in (False, True, True):  # no cache; a miss that stores; a hit on 192 of 200 tokens
        llm = make(path)
        cache = CompressedStateCache(f"file://{tmp_path}", level="lossless", chunk_tokens=C)
        if cached:
            llm.set_cache(cache)
        out = llm.create_completion(TOKENS[:200], max_tokens=4, temperature=0.0, logit_bias=LETTERS_ONLY)
        texts.append(out["choices"][0]["text"])
        hits.append(cache.hits)
    assert texts[0] == texts[1] == texts[2] and hits == [0, 0, 1]
