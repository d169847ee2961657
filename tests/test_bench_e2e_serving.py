"""The serving case through transformers' continuous batching (twinattn.bench.e2e, --cases
e2e-serving) on a tiny Llama standing in for SmolLM2: every way runs, twinattn's tokens are checked
against sdpa generate_batch's (a difference is WRONG and fails the run), the JSON and the table
carry the rows. Timings are not tested."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conftest import import_optional
from test_bench_serving import small_ceilings  # noqa: F401  the CLI's ceilings measured on small problems
from twinattn.bench import cli, e2e

torch = import_optional("torch", "the serving case")
transformers = import_optional("transformers", "the serving case")
import_optional("twinattn.hf", "the serving case")


def _tiny_llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture
def tiny_in_place_of_smollm2(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    model = _tiny_llama()
    loaded: list[str] = []
    monkeypatch.setattr(e2e, "NEEDS", ("torch", "transformers"))
    monkeypatch.setattr(e2e.models, "installed", lambda name: True)
    monkeypatch.setattr(e2e, "load_model", lambda name: loaded.append(name) or model)
    return loaded


def test_serving_case_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--list"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(e2e.SERVING + " "))
    assert "16 and 32 requests" in line and "32 new tokens" in line and "generate_batch" in line and "padded" in line


def test_serving_case_in_the_json_and_the_table(
    small_ceilings: None, tiny_in_place_of_smollm2: list[str], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "out.json"
    args = ["--cases", e2e.SERVING, "--shrink", "16", "--threads", "1", "--no-progress", "--json", str(path)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    entry = json.loads(path.read_text())["e2e_serving"]
    assert tiny_in_place_of_smollm2 == ["smollm2"]
    assert (entry["requests"], entry["new_tokens"], entry["prompt_lengths"]) == ([16, 32], 2, [2, 32])
    rows = entry["rows"]
    assert [(r["requests"], r["impl"]) for r in rows] == [(n, way) for n in (16, 32) for way in e2e.SERVING_WAYS]
    for r in rows:
        assert r["status"] == "ok" and r["threads"] == 1 and r["phase"] == "serving", r
        assert r["tokens_per_s"] == pytest.approx(r["requests"] * r["new_tokens"] * 1e3 / r["ms"])
        assert 2 * r["requests"] <= r["prompt_tokens"] <= 32 * r["requests"]
    # the attention and cache-update time of a third generate_batch call, inside that call's own, and
    # the one-new-token calls' (a fresh manager's first, then the warm one's)
    for r in rows:
        if r["impl"].endswith("generate_batch"):
            assert 0 < r["attention_ms"] and 0 < r["cache_ms"] and r["attention_ms"] + r["cache_ms"] < r["split_call_ms"], r
            assert 0 < r["prefill_ms"] and 0 < r["first_call_ms"], r
        else:
            assert not {"attention_ms", "prefill_ms", "first_call_ms"} & set(r)
    assert "cache update" in out and "prefill" in out and "first call" in out
    # the targets: twinattn's tokens/s at 32 requests over 16, and its first call beyond its prefill
    ours = {r["requests"]: r for r in rows if r["impl"] == "twinattn+generate_batch"}
    scale = ours[32]["tokens_per_s"] / ours[16]["tokens_per_s"]
    assert f"tokens/s at 32 requests / at 16: {scale:.2f}x (>= {e2e.SERVING_SCALE_TARGET}x): " in out
    beyond = max(r["first_call_ms"] - r["prefill_ms"] for r in ours.values()) / 1e3
    assert f"first call beyond its prefill: {beyond:.2f} s (<= 2 s): " in out
    # twinattn's greedy tokens are sdpa generate_batch's on every request
    assert all(r["same_tokens"] for r in rows if r["impl"] == "twinattn+generate_batch")
    assert f"\n{e2e.SERVING} (1 threads)\n" in out
    assert out.count("tokens = sdpa generate_batch's") >= 2
    assert not any(line.split()[:3] == ["case", "backend", "dtype"] for line in out.splitlines())  # no kernel table


def test_serving_case_reports_tokens_that_differ_as_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    real = e2e._serve

    def serve(model: Any, way: str, warm: Any, prompts: Any, new_tokens: int) -> Any:
        seconds, tokens, split = real(model, way, warm, prompts, new_tokens)
        if way.startswith("twinattn"):
            tokens = [[(t + 1) % 96 for t in request] for request in tokens]
        return seconds, tokens, split

    monkeypatch.setattr(e2e, "_serve", serve)
    rows = e2e.measure_serving(_tiny_llama(), requests=(3,), new_tokens=2, prompt_lengths=(2, 8), threads=1, progress=None)
    status = {r["impl"]: (r["status"], r.get("same_tokens")) for r in rows}
    assert status["twinattn+generate_batch"] == ("wrong", False)
    assert status["sdpa+generate_batch"] == ("ok", None)
    assert "WRONG: tokens differ" in e2e.format_serving_rows(rows)


def test_serving_case_without_the_model_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(e2e, "NEEDS", ("numpy", "twinattn_no_such_package"))
    assert e2e.run_serving_case(["float32"], 1, progress=None) == {
        "skipped": f"needs twinattn_no_such_package: {e2e.HOW_TO_INSTALL}"
    }
