"""Tiny GGUF models of architectures the bundled SmolLM2 is not, written with gguf-py (random
weights, a byte-level SentencePiece vocabulary): real llama.cpp runs them, so their states are the
layouts llama.cpp really writes. Weights are random, so only exactness and what loads are tested
on them, never quality. Below the writers: the tokens, contexts and logits the tests share.

- `write_lfm2`: LFM2, a hybrid model: short-convolution layers (a recurrent state) and attention
  layers (a KV cache), in one state.
- `write_mamba`: Mamba, a recurrent model: no KV cache at all.
- `write_jamba`: Jamba, a hybrid of Mamba layers and attention layers without RoPE.
- `write_deepseek2_mla`: multi-head latent attention: K rows only, no V.
- `write_qwen2vl`: M-RoPE: KV cells with llama.cpp's 12-byte extension; Qwen's K bias.
- `write_qwen3`: heads wider than n_embd / n_head, q/k norms.
- `write_gpt2`: learned position embeddings, no RoPE, fused QKV.
- `write_gpt_oss`: sliding-window layers, attention sinks, a mixture of experts.
- `write_gemma3n`: sliding-window layers, and layers that reuse earlier layers' KV.
- `write_openelm`: another number of KV heads in every layer (rows of several widths in one cache).
- `write_cohere2`: sliding-window layers with RoPE, a global layer without.
- `write_llama4`: chunked attention, a global layer without RoPE, experts.
- `write_gemma4`: heads of 16 in the window's layers and 32 in the global ones, K used as V.
- `write_granitehybrid`, `write_falcon_h1`: Mamba-2 beside attention (Falcon-H1: in every layer).
- `write_rwkv7`: RWKV-7, recurrent: a token-shift and a WKV state, no KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import llama_cachegen as lcg
import numpy as np

N_VOCAB = 3 + 256 + 26


def _vocab(w: gguf.GGUFWriter) -> None:
    """<unk>, <s>, </s>, the 256 byte tokens and ▁a..▁z."""
    letters = ["▁" + c for c in "abcdefghijklmnopqrstuvwxyz"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + letters
    types = [2, 3, 3] + [6] * 256 + [1] * 26  # unknown, control, byte, normal
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


class _Weights:
    def __init__(self, w: gguf.GGUFWriter, seed: int) -> None:
        self.w, self.rng = w, np.random.default_rng(seed)

    def random(self, name: str, *shape: int, scale: float = 0.1) -> None:
        """A tensor of ggml shape `shape` (ne0 first)."""
        self.w.add_tensor(name, (self.rng.standard_normal(shape[::-1]) * scale).astype(np.float32))

    def ones(self, name: str, n: int) -> None:
        self.w.add_tensor(name, np.ones(n, np.float32))


def _begin(
    path: Path, arch: str, n_embd: int, n_layer: int, output_norm: str = "output_norm", seed: int = 0
) -> tuple[gguf.GGUFWriter, _Weights]:
    """A writer with the vocabulary, the sizes every architecture has, the token embedding and the
    output norm."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    _vocab(w)
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    t = _Weights(w, seed)
    t.random("token_embd.weight", n_embd, N_VOCAB, scale=1.0)
    t.ones(f"{output_norm}.weight", n_embd)
    return w, t


def _ffn(t: _Weights, i: int, n_embd: int, n_ff: int, norm: str | None = "ffn_norm.weight") -> None:
    """A gated FFN, after its norm (`norm`: its tensor name in the block; None: without one)."""
    if norm is not None:
        t.ones(f"blk.{i}.{norm}", n_embd)
    t.random(f"blk.{i}.ffn_gate.weight", n_embd, n_ff)
    t.random(f"blk.{i}.ffn_down.weight", n_ff, n_embd)
    t.random(f"blk.{i}.ffn_up.weight", n_embd, n_ff)


def _attn(
    t: _Weights,
    i: int,
    n_embd: int,
    n_head: int,
    n_kv: int,
    head: int,
    *,
    bias: bool = False,
    out_bias: bool = False,
) -> None:
    t.random(f"blk.{i}.attn_q.weight", n_embd, n_head * head)
    t.random(f"blk.{i}.attn_k.weight", n_embd, n_kv * head)
    t.random(f"blk.{i}.attn_v.weight", n_embd, n_kv * head)
    t.random(f"blk.{i}.attn_output.weight", n_head * head, n_embd)
    if bias:
        t.random(f"blk.{i}.attn_q.bias", n_head * head)
        t.random(f"blk.{i}.attn_k.bias", n_kv * head, scale=3.0)  # Qwen-like: large key offsets
        t.random(f"blk.{i}.attn_v.bias", n_kv * head)
    if out_bias:
        t.random(f"blk.{i}.attn_output.bias", n_embd)


def _layer_norm(t: _Weights, name: str, n: int) -> None:
    t.ones(f"{name}.weight", n)
    t.random(f"{name}.bias", n)


def _mamba(t: _Weights, i: int, n_embd: int, d_state: int, d_conv: int, *, jamba: bool = False) -> None:
    """A Mamba-1 block (llama.cpp supports an expansion of 2 only); Jamba's norms its dt, B, C."""
    d_inner, dt_rank = 2 * n_embd, max(1, n_embd // 16)
    t.random(f"blk.{i}.ssm_in.weight", n_embd, 2 * d_inner)
    t.random(f"blk.{i}.ssm_conv1d.weight", d_conv, d_inner)
    t.random(f"blk.{i}.ssm_conv1d.bias", d_inner)
    t.random(f"blk.{i}.ssm_x.weight", d_inner, dt_rank + 2 * d_state)
    t.random(f"blk.{i}.ssm_dt.weight", dt_rank, d_inner)
    t.random(f"blk.{i}.ssm_dt.bias", d_inner)
    if jamba:
        t.ones(f"blk.{i}.ssm_dt_norm.weight", dt_rank)
        t.ones(f"blk.{i}.ssm_b_norm.weight", d_state)
        t.ones(f"blk.{i}.ssm_c_norm.weight", d_state)
    t.w.add_tensor(f"blk.{i}.ssm_a", -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1)))
    t.ones(f"blk.{i}.ssm_d", d_inner)
    t.random(f"blk.{i}.ssm_out.weight", d_inner, n_embd)


def _ssm_sizes(w: gguf.GGUFWriter, n_embd: int, d_state: int, d_conv: int) -> None:
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(2 * n_embd)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(max(1, n_embd // 16))


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_lfm2(
    path: Path, *, n_embd: int = 64, n_head: int = 4, kv_heads: Sequence[int] = (0, 2, 0, 2), n_ff: int = 128
) -> Path:
    """LFM2 with one layer per entry of `kv_heads`: 0 is a short-convolution layer, else attention
    with that many KV heads."""
    w, t = _begin(path, "lfm2", n_embd, len(kv_heads), output_norm="token_embd_norm")
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(list(kv_heads))
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    l_cache = 3
    w.add_uint32("lfm2.shortconv.l_cache", l_cache)
    head = n_embd // n_head
    for i, kv in enumerate(kv_heads):
        _ffn(t, i, n_embd, n_ff)
        t.ones(f"blk.{i}.attn_norm.weight", n_embd)
        if kv:
            t.ones(f"blk.{i}.attn_q_norm.weight", head)
            t.ones(f"blk.{i}.attn_k_norm.weight", head)
            _attn(t, i, n_embd, n_head, kv, head)
        else:
            t.random(f"blk.{i}.shortconv.conv.weight", l_cache, n_embd)
            t.random(f"blk.{i}.shortconv.in_proj.weight", n_embd, 3 * n_embd)
            t.random(f"blk.{i}.shortconv.out_proj.weight", n_embd, n_embd)
    _finish(w)
    return path


def write_mamba(path: Path, *, n_embd: int = 64, n_layer: int = 2, d_state: int = 8, d_conv: int = 4) -> Path:
    w, t = _begin(path, "mamba", n_embd, n_layer)
    _ssm_sizes(w, n_embd, d_state, d_conv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    for i in range(n_layer):
        t.ones(f"blk.{i}.attn_norm.weight", n_embd)
        _mamba(t, i, n_embd, d_state, d_conv)
    _finish(w)
    return path


def write_jamba(
    path: Path, *, n_embd: int = 64, n_head: int = 4, kv_heads: Sequence[int] = (0, 2, 0, 2), n_ff: int = 128
) -> Path:
    """Jamba with one layer per entry of `kv_heads`: 0 is a Mamba layer, else attention (no RoPE)."""
    d_state, d_conv = 8, 4
    w, t = _begin(path, "jamba", n_embd, len(kv_heads))
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(list(kv_heads))
    _ssm_sizes(w, n_embd, d_state, d_conv)
    w.add_layer_norm_rms_eps(1e-6)
    for i, kv in enumerate(kv_heads):
        t.ones(f"blk.{i}.attn_norm.weight", n_embd)
        if kv:
            _attn(t, i, n_embd, n_head, kv, n_embd // n_head)
        else:
            _mamba(t, i, n_embd, d_state, d_conv, jamba=True)
        _ffn(t, i, n_embd, n_ff)
    _finish(w)
    return path


def write_deepseek2_mla(
    path: Path, *, n_embd: int = 64, n_head: int = 2, n_layer: int = 2, kv_lora: int = 32, rope: int = 16
) -> Path:
    """DeepSeek-V2 style multi-head latent attention: the cache keeps one compressed K row per
    token (kv_lora + rope channels) and no V."""
    w, t = _begin(path, "deepseek2", n_embd, n_layer)
    nope, v_head = 16, 16
    w.add_feed_forward_length(128)
    w.add_head_count(n_head)
    w.add_head_count_kv(1)
    w.add_key_length(kv_lora + rope)  # what the cache holds per token
    w.add_value_length(kv_lora)
    w.add_uint32("deepseek2.attention.key_length_mla", nope + rope)
    w.add_uint32("deepseek2.attention.value_length_mla", v_head)
    w.add_rope_dimension_count(rope)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_q_lora_rank(0)
    w.add_kv_lora_rank(kv_lora)
    w.add_leading_dense_block_count(n_layer)  # dense layers only: no experts
    w.add_expert_feed_forward_length(64)
    w.add_expert_shared_count(0)
    for i in range(n_layer):
        t.ones(f"blk.{i}.attn_norm.weight", n_embd)
        t.ones(f"blk.{i}.attn_kv_a_norm.weight", kv_lora)
        t.random(f"blk.{i}.attn_q.weight", n_embd, n_head * (nope + rope))
        t.random(f"blk.{i}.attn_kv_a_mqa.weight", n_embd, kv_lora + rope)
        t.random(f"blk.{i}.attn_k_b.weight", nope, kv_lora, n_head)
        t.random(f"blk.{i}.attn_v_b.weight", kv_lora, v_head, n_head)
        t.random(f"blk.{i}.attn_output.weight", n_head * v_head, n_embd)
        _ffn(t, i, n_embd, 128)
    _finish(w)
    return path


def write_qwen2vl(
    path: Path, *, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2, n_layer: int = 2
) -> Path:
    """Qwen2-VL: M-RoPE (four position components per token, so every KV cell carries llama.cpp's
    12-byte extension) and Qwen's attention biases, K's large (per-channel offsets of the keys)."""
    w, t = _begin(path, "qwen2vl", n_embd, n_layer)
    head = n_embd // n_head
    w.add_feed_forward_length(128)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_sections([2, 3, 3, 0])  # pairs of the head's 16 channels per component
    for i in range(n_layer):
        t.ones(f"blk.{i}.attn_norm.weight", n_embd)
        _attn(t, i, n_embd, n_head, n_head_kv, head, bias=True)
        _ffn(t, i, n_embd, 128)
    _finish(w)
    return path


def write_qwen3(
    path: Path, *, n_embd: int = 64, n_head: int = 4, n_kv: int = 2, n_layer: int = 2, seed: int = 0
) -> Path:
    w, t = _begin(path, "qwen3", n_embd, n_layer, seed=seed)
    head = 32  # wider than n_embd / n_head, as Qwen3's are
    w.add_feed_forward_length(128)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head)
    w.add_value_length(head)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    for i in range(n_layer):
        t.ones(f"blk.{i}.attn_norm.weight", n_embd)
        _attn(t, i, n_embd, n_head, n_kv, head)
        t.random(f"blk.{i}.attn_q_norm.weight", head, scale=1.0)
        t.random(f"blk.{i}.attn_k_norm.weight", head, scale=1.0)
        _ffn(t, i, n_embd, 128)
    _finish(w)
    return path


def write_gpt2(path: Path, *, n_embd: int = 64, n_head: int = 4, n_layer: int = 2, n_ff: int = 128) -> Path:
    w, t = _begin(path, "gpt2", n_embd, n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_layer_norm_eps(1e-5)
    t.random("position_embd.weight", n_embd, 4096, scale=1.0)
    t.random("output_norm.bias", n_embd)
    for i in range(n_layer):
        _layer_norm(t, f"blk.{i}.attn_norm", n_embd)
        t.random(f"blk.{i}.attn_qkv.weight", n_embd, 3 * n_embd)
        t.random(f"blk.{i}.attn_qkv.bias", 3 * n_embd)
        t.random(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        t.random(f"blk.{i}.attn_output.bias", n_embd)
        _layer_norm(t, f"blk.{i}.ffn_norm", n_embd)
        t.random(f"blk.{i}.ffn_up.weight", n_embd, n_ff)
        t.random(f"blk.{i}.ffn_up.bias", n_ff)
        t.random(f"blk.{i}.ffn_down.weight", n_ff, n_embd)
        t.random(f"blk.{i}.ffn_down.bias", n_embd)
    _finish(w)
    return path


def write_gpt_oss(path: Path, *, n_embd: int = 64, n_head: int = 4, n_kv: int = 2, n_layer: int = 4) -> Path:
    """Every other layer slides a 128-token window; attention sinks; two experts, both used."""
    w, t = _begin(path, "gpt-oss", n_embd, n_layer)
    head, n_ff, n_expert = 16, 32, 2
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head)
    w.add_value_length(head)
    w.add_rope_dimension_count(head)
    w.add_rope_freq_base(150000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_sliding_window(128)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert)
    w.add_expert_feed_forward_length(n_ff)
    t.random("output.weight", n_embd, N_VOCAB)
    for i in range(n_layer):
        t.ones(f"blk.{i}.attn_norm.weight", n_embd)
        t.ones(f"blk.{i}.post_attention_norm.weight", n_embd)
        _attn(t, i, n_embd, n_head, n_kv, head, bias=True, out_bias=True)
        t.random(f"blk.{i}.attn_sinks.weight", n_head, scale=1.0)
        t.random(f"blk.{i}.ffn_gate_inp.weight", n_embd, n_expert)
        t.random(f"blk.{i}.ffn_gate_inp.bias", n_expert)
        for name in ("gate", "up"):
            t.random(f"blk.{i}.ffn_{name}_exps.weight", n_embd, n_ff, n_expert)
            t.random(f"blk.{i}.ffn_{name}_exps.bias", n_ff, n_expert)
        t.random(f"blk.{i}.ffn_down_exps.weight", n_ff, n_embd, n_expert)
        t.random(f"blk.{i}.ffn_down_exps.bias", n_embd, n_expert)
    _finish(w)
    return path


def write_gemma3n(path: Path, *, n_embd: int = 64, n_head: int = 4, n_kv: int = 2, n_layer: int = 25) -> Path:
    """Gemma 3n: llama.cpp fixes the layers with their own KV at the first 20, so layers 20.. reuse
    layer 18's (sliding window) or 19's (global); four layers in five slide a 128-token window."""
    w, t = _begin(path, "gemma3n", n_embd, n_layer)
    head, n_ff, n_altup, laurel, per_layer = 16, 128, 4, 64, 256
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head)
    w.add_value_length(head)
    w.add_rope_freq_base(1000000.0)
    w.add_float32("gemma3n.rope.freq_base_swa", 10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(128)
    w.add_uint32("gemma3n.embedding_length_per_layer_input", per_layer)
    t.random("altup_proj.weight", n_embd, n_embd, n_altup - 1)
    t.random("altup_unembd_proj.weight", n_embd, n_embd, n_altup - 1)
    t.random("per_layer_token_embd.weight", per_layer * n_layer, N_VOCAB)
    t.random("per_layer_model_proj.weight", n_embd, per_layer * n_layer)
    t.ones("per_layer_proj_norm.weight", per_layer)
    for i in range(n_layer):
        t.ones(f"blk.{i}.attn_norm.weight", n_embd)
        _attn(t, i, n_embd, n_head, n_kv, head)
        t.ones(f"blk.{i}.attn_q_norm.weight", head)
        t.ones(f"blk.{i}.attn_k_norm.weight", head)
        t.ones(f"blk.{i}.post_attention_norm.weight", n_embd)
        _ffn(t, i, n_embd, n_ff)
        t.ones(f"blk.{i}.post_ffw_norm.weight", n_embd)
        t.random(f"blk.{i}.inp_gate.weight", n_embd, per_layer)
        t.random(f"blk.{i}.proj.weight", per_layer, n_embd)
        t.ones(f"blk.{i}.post_norm.weight", n_embd)
        t.random(f"blk.{i}.altup_correct_coef.weight", n_altup, n_altup)
        t.ones(f"blk.{i}.altup_correct_scale.weight", n_embd)
        t.random(f"blk.{i}.altup_predict_coef.weight", n_altup, n_altup * n_altup)
        t.random(f"blk.{i}.altup_router.weight", n_embd, n_altup)
        t.ones(f"blk.{i}.altup_router_norm.weight", n_embd)
        t.random(f"blk.{i}.laurel_l.weight", n_embd, laurel)
        t.random(f"blk.{i}.laurel_r.weight", laurel, n_embd)
        t.ones(f"blk.{i}.laurel_post_norm.weight", n_embd)
    _finish(w)
    return path


def write_openelm(
    path: Path,
    *,
    n_embd: int = 64,
    heads: Sequence[int] = (2, 4, 4, 6),
    kv_heads: Sequence[int] = (1, 2, 1, 3),
    ffs: Sequence[int] = (64, 96, 128, 160),
    head: int = 16,
) -> Path:
    """OpenELM: every layer its own number of query and KV heads (and FFN width), so the K/V rows
    of one model differ in width from layer to layer (16, 32, 16, 48 values here); a fused QKV,
    q/k norms."""
    w, t = _begin(path, "openelm", n_embd, len(heads))
    w.add_feed_forward_length(list(ffs))
    w.add_head_count(list(heads))
    w.add_head_count_kv(list(kv_heads))
    w.add_key_length(head)
    w.add_value_length(head)
    w.add_rope_dimension_count(head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    for i, (nh, nkv, ff) in enumerate(zip(heads, kv_heads, ffs, strict=True)):
        t.ones(f"blk.{i}.attn_norm.weight", n_embd)
        t.random(f"blk.{i}.attn_qkv.weight", n_embd, (nh + 2 * nkv) * head)
        t.ones(f"blk.{i}.attn_q_norm.weight", head)
        t.ones(f"blk.{i}.attn_k_norm.weight", head)
        t.random(f"blk.{i}.attn_output.weight", nh * head, n_embd)
        _ffn(t, i, n_embd, ff)
    _finish(w)
    return path


def _rwkv_begin(
    path: Path, arch: str, n_embd: int, n_layer: int, n_ff: int, head: int
) -> tuple[gguf.GGUFWriter, _Weights]:
    w, t = _begin(path, arch, n_embd, n_layer)
    t.random("output_norm.bias", n_embd)
    t.ones("token_embd_norm.weight", n_embd)
    t.random("token_embd_norm.bias", n_embd)
    t.random("output.weight", n_embd, N_VOCAB)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(0)
    w.add_layer_norm_eps(1e-5)
    w.add_uint32(f"{arch}.wkv.head_size", head)
    return w, t


def write_rwkv7(path: Path, *, n_embd: int = 64, n_layer: int = 2, n_ff: int = 128, head: int = 16) -> Path:
    """RWKV-7: purely recurrent, no KV cache; per layer a token-shift state (2 * n_embd: the
    attention's and the FFN's last normed input) and a WKV state (n_embd / head heads of
    head x head), llama.cpp's r_l and s_l."""
    lora = 8
    w, t = _rwkv_begin(path, "rwkv7", n_embd, n_layer, n_ff, head)
    for key in ("decay", "iclr", "value_residual_mix", "gate"):
        w.add_uint32(f"rwkv7.attention.{key}_lora_rank", lora)
    w.add_uint32("rwkv7.token_shift_count", 2)
    for i in range(n_layer):
        for norm in ("attn_norm", "attn_norm_2", "time_mix_ln"):
            t.ones(f"blk.{i}.{norm}.weight", n_embd)
            t.random(f"blk.{i}.{norm}.bias", n_embd)
        for x in ("w", "a", "v", "g"):
            if x != "g":
                t.random(f"blk.{i}.time_mix_{x}0.weight", n_embd)
            t.random(f"blk.{i}.time_mix_{x}1.weight", n_embd, lora)
            t.random(f"blk.{i}.time_mix_{x}2.weight", lora, n_embd)
        t.w.add_tensor(f"blk.{i}.time_mix_lerp_fused.weight", np.full((6, 1, 1, n_embd), 0.5, np.float32))
        for name in ("k_k", "k_a", "r_k"):
            t.random(f"blk.{i}.time_mix_{name}.weight", n_embd, scale=0.5)
        for name in ("key", "value", "receptance", "output"):
            t.random(f"blk.{i}.time_mix_{name}.weight", n_embd, n_embd)
        t.w.add_tensor(f"blk.{i}.channel_mix_lerp_k.weight", np.full((1, 1, n_embd), 0.5, np.float32))
        t.random(f"blk.{i}.channel_mix_key.weight", n_embd, n_ff)
        t.random(f"blk.{i}.channel_mix_value.weight", n_ff, n_embd)
    _finish(w)
    return path


def _mamba2(
    t: _Weights,
    i: int,
    n_embd: int,
    d_state: int,
    d_conv: int,
    n_head: int,
    n_group: int,
    *,
    d_inner: int | None = None,
    norm: bool = True,
) -> None:
    """A Mamba-2 mixer: one in-projection to z, x, B, C and dt; a conv over x, B, C; a scalar A and
    D per head; a grouped RMS norm."""
    d_inner = d_inner or 2 * n_embd
    conv = d_inner + 2 * n_group * d_state
    t.random(f"blk.{i}.ssm_in.weight", n_embd, 2 * d_inner + 2 * n_group * d_state + n_head)
    t.random(f"blk.{i}.ssm_conv1d.weight", d_conv, conv)
    t.random(f"blk.{i}.ssm_conv1d.bias", conv)
    t.random(f"blk.{i}.ssm_dt.bias", n_head)
    t.w.add_tensor(f"blk.{i}.ssm_a", -np.arange(1, n_head + 1, dtype=np.float32).reshape(n_head, 1))
    t.w.add_tensor(f"blk.{i}.ssm_d", np.ones((n_head, 1), np.float32))
    if norm:
        t.w.add_tensor(f"blk.{i}.ssm_norm.weight", np.ones((n_group, d_inner // n_group), np.float32))
    t.random(f"blk.{i}.ssm_out.weight", d_inner, n_embd)


def _ssm2_sizes(
    w: gguf.GGUFWriter, d_inner: int, d_state: int, d_conv: int, n_head: int, n_group: int
) -> None:
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(n_head)  # Mamba-2: the number of SSM heads
    w.add_ssm_group_count(n_group)


def write_granitehybrid(
    path: Path,
    *,
    n_embd: int = 64,
    n_head: int = 4,
    kv_heads: Sequence[int] = (0, 2, 0, 0, 1),
    n_ff: int = 128,
) -> Path:
    """Granite 4.0 hybrid: Mamba-2 layers (n_head_kv 0) and attention layers with RoPE, their KV
    heads per layer; Granite's scales (embedding, residual, attention, logits)."""
    d_state, d_conv, ssm_heads, n_group = 16, 4, 8, 1
    w, t = _begin(path, "granitehybrid", n_embd, len(kv_heads))
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(list(kv_heads))
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_float32("granitehybrid.embedding_scale", 2.0)
    w.add_float32("granitehybrid.residual_scale", 0.5)
    w.add_float32("granitehybrid.attention.scale", 0.25)
    w.add_float32("granitehybrid.logit_scale", 2.0)
    _ssm2_sizes(w, 2 * n_embd, d_state, d_conv, ssm_heads, n_group)
    t.random("output.weight", n_embd, N_VOCAB)
    for i, kv in enumerate(kv_heads):
        t.ones(f"blk.{i}.attn_norm.weight", n_embd)
        if kv:
            _attn(t, i, n_embd, n_head, kv, n_embd // n_head)
        else:
            _mamba2(t, i, n_embd, d_state, d_conv, ssm_heads, n_group)
        _ffn(t, i, n_embd, n_ff)
    _finish(w)
    return path


def write_falcon_h1(
    path: Path,
    *,
    n_embd: int = 64,
    n_head: int = 4,
    n_kv: int = 2,
    n_layer: int = 3,
    n_ff: int = 128,
    d_inner: int | None = None,
    d_state: int = 16,
    ssm_heads: int = 8,
) -> Path:
    """Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side, so every layer has
    both K/V rows and a recurrent state (the KV cache and the recurrent tail span the same layers);
    K/V heads of 16 with n_embd / n_head = 16. The real models' SSM state is large: 1.5B-Deep's
    d_inner is 2.4 x n_embd at d_state 256 (its recurrent state outweighs 200 tokens of K/V)."""
    d_conv, n_group = 4, 1
    d_inner = d_inner or 2 * n_embd
    head = n_embd // n_head
    w, t = _begin(path, "falcon-h1", n_embd, n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head)
    w.add_value_length(head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    _ssm2_sizes(w, d_inner, d_state, d_conv, ssm_heads, n_group)
    t.random("output.weight", n_embd, N_VOCAB)
    for i in range(n_layer):
        t.ones(f"blk.{i}.attn_norm.weight", n_embd)
        _attn(t, i, n_embd, n_head, n_kv, head)
        _mamba2(t, i, n_embd, d_state, d_conv, ssm_heads, n_group, d_inner=d_inner)
        _ffn(t, i, n_embd, n_ff, norm="ffn_norm")  # llama.cpp asks for no ".weight" here
    _finish(w)
    return path


def write_cohere2(
    path: Path, *, n_embd: int = 64, n_head: int = 4, n_kv: int = 2, n_layer: int = 4, n_ff: int = 128
) -> Path:
    """Command R7B (cohere2): three layers in four slide a 128-token window and use RoPE; every
    fourth attends globally WITHOUT RoPE (its cached keys are unrotated, in the second cache);
    parallel attention and FFN, layer norm."""
    w, t = _begin(path, "cohere2", n_embd, n_layer)
    head = n_embd // n_head
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_eps(1e-5)
    w.add_sliding_window(128)
    w.add_uint32("cohere2.attention.sliding_window_pattern", 4)
    w.add_logit_scale(0.5)
    for i in range(n_layer):
        t.ones(f"blk.{i}.attn_norm.weight", n_embd)
        _attn(t, i, n_embd, n_head, n_kv, head)
        _ffn(t, i, n_embd, n_ff, norm=None)  # parallel to attention, after the same norm
    _finish(w)
    return path


def write_llama4(
    path: Path, *, n_embd: int = 64, n_head: int = 4, n_kv: int = 2, n_layer: int = 4, n_ff: int = 128
) -> Path:
    """Llama 4: chunked attention (llama.cpp fixes the chunk at 8192 tokens) on three layers in
    four, the fourth global and without RoPE; every other layer a mixture of two experts and a
    shared expert; L2-normed q/k on the RoPE layers."""
    w, t = _begin(path, "llama4", n_embd, n_layer)
    head, n_expert = n_embd // n_head, 2
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(head)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(1)
    w.add_expert_feed_forward_length(n_ff)
    w.add_uint32("llama4.interleave_moe_layer_step", 2)
    for i in range(n_layer):
        t.ones(f"blk.{i}.attn_norm.weight", n_embd)
        _attn(t, i, n_embd, n_head, n_kv, head)
        if (i + 1) % 2 == 0:
            t.ones(f"blk.{i}.ffn_norm.weight", n_embd)
            t.random(f"blk.{i}.ffn_gate_inp.weight", n_embd, n_expert)
            for name in ("gate", "up"):
                t.random(f"blk.{i}.ffn_{name}_exps.weight", n_embd, n_ff, n_expert)
                t.random(f"blk.{i}.ffn_{name}_shexp.weight", n_embd, n_ff)
            t.random(f"blk.{i}.ffn_down_exps.weight", n_ff, n_embd, n_expert)
            t.random(f"blk.{i}.ffn_down_shexp.weight", n_ff, n_embd)
        else:
            _ffn(t, i, n_embd, n_ff)
    _finish(w)
    return path


def write_gemma4(
    path: Path,
    *,
    n_embd: int = 64,
    n_head: int = 4,
    swa: Sequence[bool] = (True, True, False, True, True, False),
    kv_heads: Sequence[int] = (2, 2, 1, 2, 2, 1),
    n_ff: int = 128,
) -> Path:
    """Gemma 4: the sliding-window layers' heads are 16 wide, the global layers' 32 (their caches'
    rows: 2 KV heads x 16, 1 KV head x 32; RoPE over 16 and 32 channels); the global layers use K as
    V (no V projection) and proportional RoPE (rope_freqs: the upper half of the pairs unrotated)."""
    head, head_swa = 32, 16
    w, t = _begin(path, "gemma4", n_embd, len(swa))
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(list(kv_heads))
    w.add_key_length(head)
    w.add_value_length(head)
    w.add_key_length_swa(head_swa)
    w.add_value_length_swa(head_swa)
    w.add_rope_dimension_count(head)
    w.add_uint32("gemma4.rope.dimension_count_swa", head_swa)
    w.add_rope_freq_base(1000000.0)
    w.add_float32("gemma4.rope.freq_base_swa", 10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(128)
    w.add_sliding_window_pattern(list(swa))
    w.add_uint32("gemma4.embedding_length_per_layer_input", 0)
    w.add_tensor("rope_freqs.weight", np.array([1.0] * (head // 4) + [1e30] * (head // 4), np.float32))
    for i, (is_swa, kv) in enumerate(zip(swa, kv_heads, strict=True)):
        hd = head_swa if is_swa else head
        t.ones(f"blk.{i}.attn_norm.weight", n_embd)
        t.random(f"blk.{i}.attn_q.weight", n_embd, n_head * hd)
        t.random(f"blk.{i}.attn_k.weight", n_embd, kv * hd)
        if is_swa:
            t.random(f"blk.{i}.attn_v.weight", n_embd, kv * hd)
        t.random(f"blk.{i}.attn_output.weight", n_head * hd, n_embd)
        t.ones(f"blk.{i}.attn_q_norm.weight", hd)
        t.ones(f"blk.{i}.attn_k_norm.weight", hd)
        t.ones(f"blk.{i}.post_attention_norm.weight", n_embd)
        _ffn(t, i, n_embd, n_ff)
        t.ones(f"blk.{i}.post_ffw_norm.weight", n_embd)
    _finish(w)
    return path


# ---- what the tests share -------------------------------------------------------------------

N = 300  # context tokens
C = 64  # chunk tokens
_rng = np.random.default_rng(7)
TOKENS = [int(t) for t in _rng.integers(3, N_VOCAB, N)]
OTHER = [int(t) for t in _rng.integers(3, N_VOCAB, 60)]  # after TOKENS[:200]: a shared prefix
CONT = [int(t) for t in _rng.integers(3, N_VOCAB, 8)]
# completions pick letters only: a random model's byte tokens rarely form UTF-8, and
# llama-cpp-python generates on past max_tokens until they do
LETTERS_ONLY = {t: -1e9 for t in range(N_VOCAB - 26)}


def make(model: Path, **settings: Any) -> lcg.Llama:
    return lcg.Llama(str(model), **{"n_ctx": 1024, "logits_all": True, "verbose": False} | settings)


def continuation(llm: lcg.Llama, n: int) -> np.ndarray:
    """Logits of CONT after the first n positions the context holds."""
    llm.n_tokens = n
    llm.eval(CONT)
    return np.array(llm.scores[n : n + len(CONT)])


def reference_logits(model: Path, **settings: Any) -> dict[str, np.ndarray]:
    """CONT's logits after TOKENS ("all") and after TOKENS[:200] + OTHER ("other"), computed in a
    context of `settings`."""
    out = {}
    for name, tokens in (("all", TOKENS), ("other", TOKENS[:200] + OTHER)):
        llm = make(model, **settings)
        llm.eval(tokens)
        out[name] = continuation(llm, len(tokens))
    return out


def write_lora_k(path: Path, *, n_layer: int, n_embd: int, n_embd_k: int, rank: int = 8) -> Path:
    """A LoRA adapter of random weights on every layer's K projection (SmolLM2: 30, 576, 192): a
    context with it caches other keys than the model alone."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(rank))
    t = _Weights(w, seed=7)
    for i in range(n_layer):
        t.random(f"blk.{i}.attn_k.weight.lora_a", n_embd, rank, scale=0.05)
        t.random(f"blk.{i}.attn_k.weight.lora_b", rank, n_embd_k, scale=0.05)
    _finish(w)
    return path
