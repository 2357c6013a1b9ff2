"""Issue 12: each lossy level keeps its promise against llama.cpp's own cache type, per text, at 2K
tokens on the bundled model: `high` at most q8_0's KL, `balanced` at most q5_1's, `compact` at most
q4_0's, from an f16 cache and (`balanced`, `compact`) from a q8_0 cache. The cache types are
measured here, on the same texts, with flash attention (llama.cpp quantizes V only with it)
against an f16 flash-attention reference; our levels against the f16 state they were encoded from,
and from a q8_0 cache against that same reference. A level that drifts above its reference fails.

Same measurement by hand on Gemma 3 270M (interleaved sliding window, one KV head of 256 channels)
and Qwen2.5-Coder 0.5B, not in the repo, and on texts that are not either: the largest KL over the
reference's was 0.93, 0.78 and 0.81 (README, "Levels"; `compact` at 0.81 on repeated text, where
attention copies, on Gemma 3: SmolLM2 does not feel that, so no text here would catch it).
"""

from __future__ import annotations

from typing import Any

import llama_cachegen as lcg
import llama_cpp
import numpy as np
import pytest
from llama_cachegen import quality
from llama_cachegen.model import default_model_path, sample_text

N_TOKENS, CONT = 2048, 128
TEXTS = ("gpl-3.0.txt", "gfdl-1.3.txt", "difflib.py.txt")
PROMISE = {"high": "q8_0", "balanced": "q5_1", "compact": "q4_0"}
Q8_0_LEVELS = ("balanced", "compact")  # on a q8_0 cache `high` is exact


@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    model = default_model_path()
    n_ctx = N_TOKENS + CONT + 8
    vocab = quality.make_llama(model, n_ctx=64, logits_all=False, vocab_only=True)
    tokens = {t: vocab.tokenize(sample_text(t).encode(), add_bos=True)[: N_TOKENS + CONT] for t in TEXTS}
    del vocab
    kl: dict[tuple[str, str], float] = {}
    ratio: dict[tuple[str, str], float] = {}
    llm = quality.make_llama(model, n_ctx=n_ctx)
    for t in TEXTS:
        prefix, cont = tokens[t][:N_TOKENS], tokens[t][N_TOKENS:]
        state = quality.state_of(llm, prefix)
        ref = quality.continuation_logits(llm, state, prefix, cont)
        for level in PROMISE:
            blob = lcg.encode(state, level)
            logits = quality.continuation_logits(llm, lcg.decode(blob), prefix, cont)
            kl[level, t] = quality.compare_logits(ref, logits, cont)["kl"]
            ratio[level, t] = len(state) / len(blob)
    del llm
    fa = quality.make_llama(model, n_ctx=n_ctx, flash_attn=True)
    fa_ref = {
        t: quality.continuation_logits(fa, None, tokens[t][:N_TOKENS], tokens[t][N_TOKENS:]) for t in TEXTS
    }
    del fa
    for name in PROMISE.values():
        ggml_type = getattr(llama_cpp, f"GGML_TYPE_{name.upper()}")
        llm = quality.make_llama(model, n_ctx=n_ctx, flash_attn=True, type_k=ggml_type, type_v=ggml_type)
        for t in TEXTS:
            prefix, cont = tokens[t][:N_TOKENS], tokens[t][N_TOKENS:]
            state = quality.state_of(llm, prefix)
            logits = quality.continuation_logits(llm, state, prefix, cont)
            kl[name, t] = quality.compare_logits(fa_ref[t], logits, cont)["kl"]
            if name != "q8_0":
                continue
            for level in Q8_0_LEVELS:  # a q8_0 cache's values, coded at the level and quantized back
                blob = lcg.encode(state, level)
                logits = quality.continuation_logits(llm, lcg.decode(blob), prefix, cont)
                kl[f"q8_0 {level}", t] = quality.compare_logits(fa_ref[t], logits, cont)["kl"]
                ratio[f"q8_0 {level}", t] = len(state) / len(blob)
        del llm
    return {"kl": kl, "ratio": ratio}


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("level", list(PROMISE))
def test_level_keeps_its_promise_on_every_text(measured: dict[str, Any], level: str, text: str) -> None:
    ours, theirs = measured["kl"][level, text], measured["kl"][PROMISE[level], text]
    assert 0.0 < ours <= theirs, f"{level}: KL {ours:.4f} above {PROMISE[level]}'s {theirs:.4f} on {text}"


def test_levels_order_by_size_and_quality(measured: dict[str, Any]) -> None:
    for t in TEXTS:
        ratios = [measured["ratio"][level, t] for level in PROMISE]
        kls = [measured["kl"][level, t] for level in PROMISE]
        assert ratios == sorted(ratios) and ratios[0] > 1.5, ratios
        assert kls == sorted(kls), kls
    assert np.mean([measured["ratio"]["compact", t] for t in TEXTS]) > 4.4


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("level", Q8_0_LEVELS)
def test_level_keeps_its_promise_on_a_q8_0_cache(measured: dict[str, Any], level: str, text: str) -> None:
    """A context with q8_0 caches (flash attention), saved at the level: its KL against the f16
    cache stays at most the level's reference cache type's, and it is at least 1.6x smaller than
    the q8_0 state (measured: 2.07x and 2.37x on four texts)."""
    ours, theirs = measured["kl"][f"q8_0 {level}", text], measured["kl"][PROMISE[level], text]
    assert 0.0 < ours <= theirs, (
        f"{level} of q8_0: KL {ours:.4f} above {PROMISE[level]}'s {theirs:.4f} on {text}"
    )
    assert measured["ratio"][f"q8_0 {level}", text] > 1.6
