"""Quality of a (reconstructed) context state, measured the way the design notes define it.

Teacher forcing: load the state into a context, evaluate a known continuation, and compare the
next-token distributions with those of the untouched state (mean KL divergence, top-1 agreement,
perplexity difference).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InvalidArgumentError
from .llama_format import GGML_TYPES
from .model import default_model_path


def ggml_type(name: str | int) -> int:
    """The ggml type id of a KV cache type name ("q8_0") or id."""
    if isinstance(name, int):
        return name
    if name not in GGML_TYPES:
        raise InvalidArgumentError(f"unknown KV cache type {name!r}; expected one of {', '.join(GGML_TYPES)}")
    return GGML_TYPES[name]


def make_llama(
    model_path: str | Path | None = None,
    *,
    n_ctx: int = 2048,
    flash_attn: bool = False,
    type_k: str | int | None = None,
    type_v: str | int | None = None,
    n_threads: int = 2,
    logits_all: bool = True,
    cls: type | None = None,
    **kwargs: Any,
) -> Any:
    """A quiet llama_cpp.Llama (or `cls`) on the default model, sized for measurement."""
    import llama_cpp

    params: dict[str, Any] = dict(
        model_path=str(model_path or default_model_path()),
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=n_threads,
        n_threads_batch=n_threads,
        flash_attn=flash_attn,
        logits_all=logits_all,
        verbose=False,
    )
    if type_k is not None:
        params["type_k"] = ggml_type(type_k)
    if type_v is not None:
        params["type_v"] = ggml_type(type_v)
    params.update(kwargs)
    return (cls or llama_cpp.Llama)(**params)


def clear_context(llm: Any) -> None:
    """Empties the KV cache and llama-cpp-python's token bookkeeping."""
    import llama_cpp

    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
    llm.n_tokens = 0


def load_seq_state(llm: Any, state: bytes | bytearray, seq_id: int = 0) -> None:
    """llama_state_seq_set_data into an emptied context; raises if llama.cpp refuses it."""
    from .llama import restore_state

    clear_context(llm)
    if not restore_state(llm, state, seq_id):
        raise RuntimeError("llama.cpp refused the sequence state (llama_state_seq_set_data returned 0)")


def state_of(llm: Any, tokens: Sequence[int]) -> bytes:
    """Evaluates `tokens` from an empty context and returns sequence 0's state."""
    from .llama import capture_state

    clear_context(llm)
    llm.eval(list(tokens))
    return capture_state(llm, 0)


def continuation_logits(
    llm: Any, state: bytes | None, prefix_tokens: Sequence[int], cont_tokens: Sequence[int]
) -> np.ndarray:
    """Logits (len(cont), n_vocab) at each continuation token, teacher-forced.

    The context is `state` loaded as sequence 0 (or, with None, `prefix_tokens` prefilled);
    row i is the distribution predicting cont_tokens[i + 1]. Needs logits_all=True.
    """
    if state is None:
        clear_context(llm)
        llm.eval(list(prefix_tokens))
    else:
        load_seq_state(llm, state, 0)
        llm.input_ids[: len(prefix_tokens)] = prefix_tokens
        llm.n_tokens = len(prefix_tokens)
    start = llm.n_tokens
    llm.eval(list(cont_tokens))
    return np.array(llm.scores[start : start + len(cont_tokens)], dtype=np.float64)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare_logits(ref: np.ndarray, test: np.ndarray, cont_tokens: Sequence[int]) -> dict[str, float]:
    """Mean KL(ref || test), top-1 agreement and perplexity difference over the continuation."""
    ref_lp, test_lp = _log_softmax(ref), _log_softmax(test)
    kl = float(np.mean(np.sum(np.exp(ref_lp) * (ref_lp - test_lp), axis=-1)))
    top1 = float(np.mean(ref_lp.argmax(axis=-1) == test_lp.argmax(axis=-1)))
    targets = np.asarray(cont_tokens[1:])
    rows = np.arange(len(targets))
    ppl_ref = float(np.exp(-ref_lp[rows, targets].mean()))
    ppl_test = float(np.exp(-test_lp[rows, targets].mean()))
    return {"kl": max(kl, 0.0), "top1": top1, "dppl": ppl_test - ppl_ref}
