"""The serving cases of twinattn-bench (twinattn.bench.serving) on tiny shapes: every way of every
case computes the same problem (checked against float64), a wrong way is reported as WRONG and
never timed, the ratios are to the paged call, and the CLI runs them. Timings are not tested."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import NATIVE_BACKENDS, _require
from twinattn.bench import cli, machine, serving
from twinattn.bench.timing import Budget

TINY = Budget(time_s=0.0, min_repeats=1, warmup_s=0.0)
SHRINK = 64


@pytest.fixture
def small_ceilings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's ceilings measured on small problems (what tests/test_bench.py does)."""
    monkeypatch.setattr(machine, "GEMM_N", 128)
    monkeypatch.setattr(machine, "READ_BYTES", 4 << 20)
    monkeypatch.setattr(machine, "settle", lambda: None)


@pytest.mark.parametrize("name", list(serving.CASES))
def test_every_way_checks_and_is_timed(name: str) -> None:
    entry = serving.run_case(name, ["numpy"], TINY, shrink=SHRINK, with_torch=False)
    ways = {row["way"]: row for row in entry["rows"]}
    assert serving.PAGED in ways and len(ways) == 2, ways
    for row in entry["rows"]:
        assert row["status"] == "ok", row
        assert row["max_err"] < 1e-5 and len(row["times"]) == 1
    assert ways[serving.PAGED]["vs_paged"] == 1.0
    other = next(row for way, row in ways.items() if way != serving.PAGED)
    assert other["vs_paged"] == pytest.approx(other["median_s"] / ways[serving.PAGED]["median_s"])


@pytest.mark.parametrize("port", NATIVE_BACKENDS)
def test_native_ports_and_torch(port: str) -> None:
    _require(port)
    pytest.importorskip("torch")
    entry = serving.run_case("chunked-prefill", [port], TINY, shrink=SHRINK)
    assert [(r["way"], r["backend"], r["status"]) for r in entry["rows"]] == [
        ("paged", port, "ok"), ("separate-calls", port, "ok"), ("torch-sdpa", "torch", "ok")]


def test_cascade_shares_the_prefix_blocks() -> None:
    scenario = serving.build("cascade", ["numpy"], shrink=SHRINK, with_torch=False)
    assert scenario.notes == ["pool blocks: shared 20, private copies 80"]
    out = scenario.ways[0][2]()
    assert out.shape == (16, serving.Q_HEADS, serving.HEAD_DIM)


def test_a_wrong_way_is_reported_and_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    build = serving.build

    def broken(*args: object, **kwargs: object) -> serving.Scenario:
        scenario = build(*args, **kwargs)  # type: ignore[arg-type]
        way, backend, call = scenario.ways[1]
        scenario.ways[1] = (way, backend, lambda: call() * 1.01)
        return scenario

    monkeypatch.setattr(serving, "build", broken)
    entry = serving.run_case("paged-decode", ["numpy"], TINY, shrink=SHRINK, with_torch=False)
    wrong = entry["rows"][1]
    assert wrong["status"] == "wrong" and "max abs error" in wrong["note"] and "times" not in wrong
    assert "WRONG" in serving.format_rows([entry])


def test_names_in() -> None:
    assert serving.names_in(["serving"]) == list(serving.CASES)
    assert serving.names_in(["decode", "serving/cascade", "serving/cascade"]) == ["cascade"]
    with pytest.raises(ValueError, match="unknown serving case 'serving/nope'"):
        serving.names_in(["serving/nope"])


def test_cli_runs_the_serving_cases(small_ceilings: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--list"]) == 0
    assert "serving/paged-decode-block1" in capsys.readouterr().out
    status = cli.main(["--cases", "serving/paged-decode", "--backends", "numpy", "--shrink", str(SHRINK), "--repeat", "1",
                       "--no-progress"])
    out = capsys.readouterr().out
    assert status == 0, out
    lines = [line for line in out.splitlines() if line.startswith("serving/paged-decode ")]
    assert [line.split()[1] for line in lines] == ["paged", "contiguous"], out
    assert "vs paged" in out
    assert np.isfinite(float(lines[1].split()[5].rstrip("x")))


def test_serving_cases_run_only_when_named(small_ceilings: None, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []

    def run_case(name: str, *args: object, **kwargs: object) -> dict[str, object]:
        ran.append(name)
        return {"case": serving.CASES[name].name, "title": "", "notes": [], "rows": []}

    monkeypatch.setattr(serving, "run_case", run_case)
    monkeypatch.setattr(cli, "standard_suite", lambda threads: [])
    cli.main(["--backends", "numpy", "--no-progress", "--quick"])
    assert ran == []
    cli.main(["--cases", "serving/cascade", "--backends", "numpy", "--no-progress"])
    assert ran == ["cascade"]
