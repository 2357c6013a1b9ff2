"""The `llama-cachegen` command line, run as real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from conftest import kv_cache_bytes, seq_buffer, smollm
from llama_cachegen import chunks, cli
from llama_cachegen.cli import DEMO_QUESTION
from llama_cachegen.llama import Llama
from llama_cachegen.model import default_model_path


def _cli(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "llama_cachegen", *map(str, args)], capture_output=True, text=True, timeout=300
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def slot_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama-server slot file: llama_state_seq_save_file of a real context; beside it the same
    context saved as a container (saved.lcg) and chunked (the manifest ctx, its objects in lcg4/)."""
    path = tmp_path_factory.mktemp("slot") / "slot0.bin"
    llm = smollm()
    tokens = llm.tokenize(b"The quick brown fox jumps over the lazy dog. " * 6)
    llm.eval(tokens)
    array = (llama_cpp.llama_token * len(tokens))(*tokens)
    assert llama_cpp.llama_state_seq_save_file(llm.ctx, str(path).encode(), 0, array, len(tokens)) > 0
    llm.save_compressed_state(path.with_name("saved.lcg"), level="high")
    llm.save_compressed_state(path.with_name("ctx"), levels=("balanced",), chunk_tokens=16)
    return path


def test_compress_decompress_inspect_slot_file(slot_file: Path, tmp_path: Path) -> None:
    packed, unpacked = tmp_path / "slot.lcg", tmp_path / "slot.bin"
    result = json.loads(_cli("compress", slot_file, packed, "--level", "lossless", "--json").stdout)
    assert result["compressed_bytes"] == packed.stat().st_size and result["ratio"] > 1
    assert "->" in _cli("decompress", packed, unpacked).stdout
    assert unpacked.read_bytes() == slot_file.read_bytes()
    info = json.loads(_cli("inspect", packed, "--json").stdout)
    assert (
        info["type"] == "llama-cachegen container"
        and info["kind"] == "seq_file"
        and info["level"] == "lossless"
    )
    raw = json.loads(_cli("inspect", slot_file, "--json").stdout)
    assert raw["type"] == "llama.cpp state" and raw["kind"] == "seq_file" and raw["cells"] == info["cells"]
    text = _cli("inspect", slot_file.as_uri()).stdout
    assert text.startswith(f"{slot_file.as_uri()}: llama.cpp state") and "cells:" in text


def test_inspect_shows_the_llama_cpp_python_envelope(slot_file: Path) -> None:
    info = json.loads(_cli("inspect", slot_file.with_name("saved.lcg"), "--json").stdout)
    envelope = info["llama_cpp_python"]
    assert envelope["scope"] == "all" and envelope["tokens"] == info["cells"]
    assert envelope["fingerprint"]["arch"] == "llama" and envelope["fingerprint"]["type_k"] == "f16"
    assert "fingerprint:" in _cli("inspect", slot_file.with_name("saved.lcg")).stdout
    assert "saved from" not in envelope


def test_inspect_says_when_a_lossless_save_holds_lossy_kv(slot_file: Path, tmp_path: Path) -> None:
    """K/V loaded at balanced and saved lossless: `inspect` showed only "levels: lossless", which
    reads as exact (the loaders know better, from the record it now shows)."""
    llm = smollm()
    llm.load_compressed_state(slot_file.with_name("ctx"))  # chunks at balanced
    llm.save_compressed_state(tmp_path / "again", levels=("lossless",))
    llm.save_compressed_state(tmp_path / "again.lcg", level="lossless")
    manifest = json.loads(_cli("inspect", tmp_path / "again", "--json").stdout)
    whole = json.loads(_cli("inspect", tmp_path / "again.lcg", "--json").stdout)["llama_cpp_python"]
    for info in (manifest, whole):
        assert info["saved from"].startswith("K/V decoded from balanced from position 4 on"), (
            info
        )  # 4 sinks exact


def test_inspect_shows_a_manifest_and_every_cache(slot_file: Path, tmp_path: Path) -> None:
    llm = smollm()
    llm.eval(llm.tokenize(b"The quick brown fox jumps over the lazy dog. " * 6))
    llm.save_compressed_state(tmp_path / "a", levels=("balanced", "compact"), chunk_tokens=16)
    llm.eval(llm.tokenize(b" And then it ran away."))
    llm.save_compressed_state(tmp_path / "b", levels=("balanced", "compact"), chunk_tokens=16)
    info = json.loads(_cli("inspect", tmp_path / "b", "--json").stdout)
    assert info["type"] == "llama-cachegen manifest" and info["levels"] == ["balanced", "compact"]
    assert info["tokens"] == llm.n_tokens and info["chunks"] == -(-llm.n_tokens // 16)
    shared = (info["tokens"] - len(llm.tokenize(b" And then it ran away.", add_bos=False))) // 16
    assert info["chunks stored by earlier saves"] == {"balanced": shared, "compact": shared}
    # a chunk: its positions, and no state figures (they read 0: no tokens, ratio 0, not chunkable)
    chunk = next(p for p in tmp_path.rglob("*") if p.is_file() and "/chunks/" in p.as_posix())
    text = _cli("inspect", chunk).stdout
    assert "part: chunk" in text and "positions: (" in text
    assert not any(f"  {key}:" in text for key in ("tokens", "state_size", "ratio", "chunkable")), text
    # an interleaved sliding-window state: both caches are reported
    rng = np.random.default_rng(0)
    iswa = tmp_path / "iswa.bin"
    iswa.write_bytes(
        seq_buffer(kv_cache_bytes(rng, cells_per_stream=(9,)) + kv_cache_bytes(rng, cells_per_stream=(5,)))
    )
    raw = json.loads(_cli("inspect", iswa, "--json").stdout)
    assert raw["caches"] == 2 and raw["cells"] == 14 and raw["tensors"] == 8


def test_errors_are_reported_not_raised(slot_file: Path, tmp_path: Path) -> None:
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a state at all" * 10)
    proc = _cli("inspect", junk, check=False)
    assert proc.returncode == 1 and "inspect: error:" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli("decompress", tmp_path / "missing.lcg", tmp_path / "out", check=False)
    assert proc.returncode == 1 and "error:" in proc.stderr
    proc = _cli("load", slot_file.with_name("ctx"), "--model", junk, check=False)  # not a GGUF
    assert proc.returncode == 1 and "cannot load the model" in proc.stderr and "Traceback" not in proc.stderr
    stub = tmp_path / "stub"
    stub.write_bytes(b"LCGM")  # a manifest's magic and nothing else
    proc = _cli("inspect", stub, check=False)
    assert proc.returncode == 1 and "a llama-cachegen manifest cut short: 4 bytes" in proc.stderr
    # each of these was a traceback
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe not text")
    for args, says in (
        (("inspect", "http://[::1/x"), "malformed URL"),
        (("eval", "--text", binary, "--tokens", "64"), "is not UTF-8 text"),
        (("demo", "--tokens", "120", "--n-ctx", "128"), "do not fit --n-ctx 128"),
    ):
        proc = _cli(*args, check=False)
        assert proc.returncode == 1 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_load_refuses_a_manifest_longer_than_the_models_training_context(tmp_path: Path) -> None:
    """`load` sized its context from the manifest's token count before any chunk was read: a
    forged count was allocated first (60,000 tokens of SmolLM2: 1.5 GB) and refused only then."""
    llm = smollm()
    llm.eval(llm.tokenize(b"The quick brown fox jumps over the lazy dog. " * 6))
    llm.save_compressed_state(tmp_path / "ctx", levels=("balanced",), chunk_tokens=16)
    m = chunks.Manifest.unpack((tmp_path / "ctx").read_bytes())
    n_ctx_train = llama_cpp.llama_model_n_ctx_train(llm.model)
    m.meta.tokens = np.resize(m.meta.tokens, n_ctx_train + 1)
    m.chunks = [m.chunks[0]] * -(-(n_ctx_train + 1) // 16)
    (tmp_path / "forged").write_bytes(m.pack())
    proc = _cli("load", tmp_path / "forged", "--threads", "1", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"holds {n_ctx_train + 1} tokens, more than" in proc.stderr
    assert f"training context ({n_ctx_train}); give --n-ctx" in proc.stderr


def test_load_says_what_it_was_given(slot_file: Path, tmp_path: Path) -> None:
    """`load` of a llama.cpp state said "not a llama-cachegen container" only, and of a context saved
    from another model without --model, not that --model names it."""
    from tiny_models import make, write_gpt2

    proc = _cli("load", slot_file, "--threads", "1", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert (
        f"{slot_file} is a llama.cpp state (seq_file), not a container: there is nothing to load"
        in proc.stderr
    )
    tiny = make(write_gpt2(tmp_path / "gpt2.gguf"))
    tiny.eval(tiny.tokenize(b"The quick brown fox jumps over the lazy dog. " * 4))
    tiny.save_compressed_state(tmp_path / "ctx", levels=("lossless",), chunk_tokens=16)
    proc = _cli("load", tmp_path / "ctx", "--threads", "1", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "state does not fit this model/context" in proc.stderr and "with --model GGUF" in proc.stderr
    model = tmp_path / "gpt2.gguf"
    proc = _cli("load", tmp_path / "ctx", "--model", model, "--threads", "1", "--json", check=False)
    assert proc.returncode == 0 and json.loads(proc.stdout)["tokens"] == tiny.n_tokens, proc.stderr


def test_ctrl_c_ends_a_command_with_one_line_and_status_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Ctrl-C printed a traceback (the load itself puts the context back: test_stream)."""

    def interrupted(_args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_load", interrupted)
    assert cli.main(["load", "file:///nowhere/ctx"]) == 130
    assert capsys.readouterr().err == "llama-cachegen load: interrupted\n"


def test_threads_bound_the_prefill_too(model_path: Path) -> None:
    """`--threads 1` (demo, load) left llama-cpp-python's n_threads_batch at every core: the
    prefill, the stream's calibration and its text chunks ran on all of them."""
    llm = cli._open_llama(str(model_path), 64, 1)
    assert (llm.context_params.n_threads, llm.context_params.n_threads_batch) == (1, 1)


def test_decompress_says_what_a_non_container_is(slot_file: Path, tmp_path: Path) -> None:
    manifest = slot_file.with_name("ctx")
    proc = _cli("decompress", manifest, tmp_path / "out", check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"{manifest} is a chunked context's manifest, not a container" in proc.stderr
    assert f"llama-cachegen load {manifest}" in proc.stderr
    proc = _cli("decompress", slot_file, tmp_path / "out", check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert f"{slot_file} is a llama.cpp state (seq_file), not a container" in proc.stderr
    skeleton = next((slot_file.parent / chunks.PREFIX / "skeletons").iterdir())
    proc = _cli("decompress", skeleton, tmp_path / "out", check=False)
    assert proc.returncode == 1 and "chunked context's skeleton object, not a whole container" in proc.stderr
    truncated = tmp_path / "truncated.lcg"
    truncated.write_bytes(slot_file.with_name("saved.lcg").read_bytes()[:-100])
    proc = _cli("decompress", truncated, tmp_path / "out", check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "LCG_ERR_TRUNCATED" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_inspect_verifies_checksums(slot_file: Path, tmp_path: Path) -> None:
    saved = slot_file.with_name("saved.lcg")
    assert "\n  checksums: ok\n" in _cli("inspect", saved).stdout
    assert json.loads(_cli("inspect", saved, "--json").stdout)["checksums"] == "ok"
    blob = bytearray(saved.read_bytes())
    blob[len(blob) // 2] ^= 0x10  # inside a tensor section: the header still reads
    damaged = tmp_path / "damaged.lcg"
    damaged.write_bytes(blob)
    proc = _cli("inspect", damaged, check=False)
    assert proc.returncode == 1 and "level: high" in proc.stdout and "fingerprint:" in proc.stdout
    assert "\n  checksums: FAILED (LCG_ERR_CHECKSUM: tensor section at offset " in proc.stdout
    proc = _cli("inspect", damaged, "--json", check=False)
    assert proc.returncode == 1 and json.loads(proc.stdout)["checksums"].startswith("FAILED (")
    assert "checksums" not in json.loads(_cli("inspect", slot_file, "--json").stdout)


def test_demo_answers_the_same_from_a_second_process(tmp_path: Path) -> None:
    proc = _cli(
        "demo",
        "--tokens",
        "96",
        "--n-ctx",
        "512",
        "--threads",
        "2",
        "--max-tokens",
        "8",
        "--level",
        "lossless",
        "--store",
        tmp_path.as_uri(),
        "--json",
    )
    summary = json.loads(proc.stdout)
    # lossless: the restored answer must match exactly (lossy levels may legitimately differ)
    assert summary["tokens"] == 96 and summary["answer_matches"]
    assert summary["answer_restored"] == summary["answer_uncompressed"] != ""
    assert summary["compressed_bytes"] == (tmp_path / "demo-lossless.lcg").stat().st_size
    llm = Llama(str(default_model_path()), n_ctx=512, verbose=False, vocab_only=True)
    assert summary["tokens_evaluated_after_load"] == len(llm.tokenize(DEMO_QUESTION.encode(), add_bos=False))
    assert "prefill" in proc.stderr  # progress on stderr


def test_save_then_load_answers_as_the_prefilled_context(tmp_path: Path) -> None:
    """`save` prefills a text and stores it in chunks; `load --prompt` continues what it loaded: at
    lossless, with the answer of a context that prefilled the text itself, the prompt evaluated alone."""
    text = tmp_path / "doc.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    store = tmp_path / "store"
    args = ("--text", text, "--tokens", "300", "--chunk-tokens", "128", "--threads", "2", "--json")
    proc = _cli("save", store / "ctx", "--levels", "lossless", "balanced", *args)
    saved = json.loads(proc.stdout)
    assert (saved["n_tokens"], saved["chunks"], saved["chunk_tokens"], saved["fallback"]) == (
        300,
        3,
        128,
        None,
    )
    assert saved["objects_present"] == 0 and set(saved["level_bytes"]) == {"lossless", "balanced"}
    again = json.loads(_cli("save", store / "ctx2", "--levels", "lossless", *args).stdout)
    assert again["objects_present"] >= 3 and again["level_bytes"] == {}  # its chunks were there

    proc = _cli(
        "load", store / "ctx", "--level", "lossless", "--prompt", DEMO_QUESTION, "--max-tokens", "8", "--json"
    )
    loaded = json.loads(proc.stdout)
    llm = smollm(n_ctx=512)
    tokens = llm.tokenize(text.read_bytes())[:300]
    question = llm.tokenize(DEMO_QUESTION.encode(), add_bos=False)
    llm.eval(tokens)  # as `save` did: the prompt is evaluated on top
    assert loaded["tokens"] == 300 and loaded["prompt_tokens_evaluated"] == len(question)
    assert loaded["answer"] == cli._answer(llm, tokens + question, 8)[0] != ""

    proc = _cli("save", store / "ctx3", "--text", text, "--n-ctx", "64", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "tokens do not fit --n-ctx 64: give a larger --n-ctx or fewer --tokens" in proc.stderr
    (tmp_path / "empty.txt").write_text("")
    proc = _cli("save", store / "ctx3", "--text", tmp_path / "empty.txt", check=False)
    assert proc.returncode == 1 and "holds no tokens: there is no context to save" in proc.stderr
    proc = _cli("load", store / "ctx", "--max-tokens", "4", check=False)
    assert proc.returncode == 1 and "--max-tokens goes with a --prompt" in proc.stderr
    proc = _cli("save", store / "ctx3", "--text", tmp_path / "missing.txt", check=False)
    assert (
        proc.returncode == 1 and "No such file or directory" in proc.stderr and "Traceback" not in proc.stderr
    )
    assert not (store / "ctx3").exists()


def test_eval_reports_quality_per_level_and_llama_cpp_types() -> None:
    proc = _cli(
        "eval",
        "--tokens",
        "96",
        "--cont",
        "24",
        "--threads",
        "2",
        "--levels",
        "lossless",
        "balanced",
        "--cache-types",
        "q8_0",
        "q5_1",
        "--json",
    )
    result = json.loads(proc.stdout)
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {
        "llama-cachegen lossless",
        "llama-cachegen balanced",
        "llama.cpp f16, flash attention (noise floor)",
        "llama.cpp q8_0",
        "llama.cpp q5_1",
    }
    # the floor: an exact f16 cache computed another way moves the logits, less than q5_1 does
    assert result["floor_kl"] == rows["llama.cpp f16, flash attention (noise floor)"]["kl"]
    assert 0 <= result["floor_kl"] < rows["llama.cpp q5_1"]["kl"]
    assert rows["llama-cachegen lossless"]["kl"] < 1e-9 and rows["llama-cachegen lossless"]["top1"] == 1.0
    assert rows["llama-cachegen balanced"]["ratio"] > rows["llama-cachegen lossless"]["ratio"]
    assert 0 < rows["llama.cpp q8_0"]["kl"] < rows["llama.cpp q5_1"]["kl"] < 0.1
    (promise,) = result["promises"].values()  # balanced vs q5_1: the verdict follows the figures
    assert promise["reference"] == "q5_1" and promise["holds"] == (promise["kl"] <= promise["reference_kl"])
    worst = max(promise["kl"], promise["reference_kl"])
    assert promise["negligible"] == (worst <= 1e-6)
    assert promise["within_floor"] == (worst <= max(1.5 * result["floor_kl"], 1e-6))
    assert promise["reference_broken"] is False  # q5_1 works on SmolLM2 (on Qwen2.5 it does not)
    proc = _cli("eval", "--cache-types", "q5", check=False)  # a name llama.cpp has no type for
    assert proc.returncode == 2 and "invalid choice: 'q5'" in proc.stderr
    # more tokens than the text can hold: said before a context that size is allocated (GBs)
    proc = _cli("eval", "--tokens", "100000000", check=False)
    assert proc.returncode == 1 and "bytes, fewer than --tokens + --cont" in proc.stderr


def test_eval_measures_the_levels_on_a_q8_0_cache() -> None:
    """`--kv-type q8_0`: the levels encode a q8_0 cache's state and are measured, as the cache
    types are, against an f16 cache with flash attention; sizes are against the f16 state. `high`
    carries it exactly: its promise is not checked (it would hold trivially); with a q4_0 cache
    every level does (they were all said not to hold against q8_0's and q5_1's KL)."""
    args = ("--tokens", "96", "--cont", "24", "--threads", "2", "--json")
    proc = _cli(
        "eval", *args, "--kv-type", "q8_0", "--levels", "high", "balanced", "--cache-types", "q8_0", "q5_1"
    )
    result = json.loads(proc.stdout)
    rows = {r["method"]: r for r in result["rows"]}
    assert result["kv_type"] == "q8_0" and result["kv_state_bytes"] < 0.6 * result["state_bytes"]
    # `high` carries a q8_0 cache exactly: the q8_0 cache's own figures
    assert rows["llama-cachegen high"]["kl"] == pytest.approx(rows["llama.cpp q8_0"]["kl"], abs=1e-9)
    assert result["exact_on_kv"] == ["high"] and set(result["promises"]) == {"balanced"}
    assert rows["llama-cachegen balanced"]["ratio"] > 1.3 * rows["llama.cpp q8_0"]["ratio"]  # measured: 1.54
    assert rows["llama-cachegen balanced"]["kl"] != rows["llama-cachegen high"]["kl"]  # lossy: other logits
    proc = _cli("eval", *args, "--kv-type", "q4_0", "--levels", "high", "compact", "--cache-types", "q4_0")
    result = json.loads(proc.stdout)
    assert result["exact_on_kv"] == ["high", "compact"] and result["promises"] == {}
    proc = _cli("eval", "--kv-type", "q5", check=False)  # a name llama.cpp has no type for
    assert proc.returncode == 2 and "invalid choice: 'q5'" in proc.stderr


def test_in_place_overwrite_needs_force_and_is_atomic(slot_file: Path, tmp_path: Path) -> None:
    state = tmp_path / "state.bin"
    state.write_bytes(slot_file.read_bytes())
    for same in (state, tmp_path / "." / "state.bin", state.as_uri()):
        proc = _cli("compress", state, same, check=False)
        assert proc.returncode == 1 and "is the input too" in proc.stderr and "--force" in proc.stderr
        assert state.read_bytes() == slot_file.read_bytes()  # the raw state is untouched
    (tmp_path / "link.bin").symlink_to(state)
    assert _cli("decompress", state, tmp_path / "link.bin", check=False).returncode == 1
    _cli("compress", state, state, "--force", "--level", "lossless")
    assert json.loads(_cli("inspect", state, "--json").stdout)["type"] == "llama-cachegen container"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    _cli("decompress", state, state, "--force")
    assert state.read_bytes() == slot_file.read_bytes()


@pytest.mark.parametrize(
    "args",
    [
        ("compress", "a", "b", "--threads", "-3"),
        ("compress", "a", "b", "--threads", "0"),
        ("demo", "--tokens", "many"),
        ("eval", "--cont", "-1"),
        ("eval", "--cont", "1"),  # no token to score: a traceback in the perplexity
        ("serve", "--dir", ".", "--port", "70000"),
        ("serve", "--dir", ".", "--body-timeout", "nan"),
    ],
)
def test_numeric_options_are_validated(args: tuple[str, ...]) -> None:
    proc = _cli(*args, check=False)
    assert proc.returncode == 2 and "expected a" in proc.stderr and "Traceback" not in proc.stderr


def test_internal_worker_is_hidden_and_messages_are_clean(tmp_path: Path) -> None:
    assert "_demo-worker" not in _cli("--help").stdout
    assert "_demo-worker" not in _cli("nonsense", check=False).stderr
    proc = _cli("decompress", tmp_path / "missing.bin", tmp_path / "out", check=False)
    assert proc.stderr.strip() == f"llama-cachegen decompress: error: no file {tmp_path / 'missing.bin'}"
    proc = _cli("eval", "--text", str(tmp_path / "missing.txt"), check=False)
    assert "error: No such file or directory:" in proc.stderr and "'" not in proc.stderr


def test_a_key_tags_containers_not_llama_cpp_files(
    slot_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With LLAMA_CACHEGEN_KEY set (as on every proxy host) compress refused every slot file
    ("carries no authentication tag") and decompress wrote the state behind a tag header, a file
    llama.cpp cannot load, with exit status 0. llama.cpp's files carry no tag; containers do."""
    from llama_cachegen.stores import TAG_MAGIC

    plain = tmp_path / "plain.lcg"
    _cli("compress", slot_file, plain, "--level", "lossless")
    monkeypatch.setenv("LLAMA_CACHEGEN_KEY", "k3y")
    packed, unpacked = tmp_path / "slot.lcg", tmp_path / "slot.bin"
    _cli("compress", slot_file, packed, "--level", "lossless")
    assert packed.read_bytes().startswith(TAG_MAGIC)
    _cli("decompress", packed, unpacked)
    assert unpacked.read_bytes() == slot_file.read_bytes()
    assert json.loads(_cli("inspect", slot_file, "--json").stdout)["type"] == "llama.cpp state"
    untagged = _cli("inspect", plain, check=False)  # a container must still carry its tag
    assert untagged.returncode == 1 and "tag" in untagged.stderr
