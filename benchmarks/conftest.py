"""pytest-benchmark suites over twinattn-bench's own cases and backends.

    pytest benchmarks/ --benchmark-only                       # the standard suite, every backend
    pytest benchmarks/ --benchmark-only --bench-quick         # twinattn-bench --quick's cases
    pytest benchmarks/ --benchmark-only --bench-cases decode --bench-backends cpp,rust

The cases, inputs, checks and backends are imported from twinattn.bench (suite.py, peers.py), so
these numbers and the CLI's agree. Each test is one (case, backend), in the group of its case;
extra_info carries GFLOP/s and GB/s. Not part of the test command (pyproject's testpaths is tests/).
"""

from __future__ import annotations

from typing import Callable

import pytest
import twinattn
from twinattn.bench import peers, suite, timing


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("twinattn-bench")
    group.addoption("--bench-cases", default=None, help="cases, groups or globs, as twinattn-bench --cases")
    group.addoption("--bench-backends", default=None, help="backends, as twinattn-bench --backends")
    group.addoption("--bench-quick", action="store_true", help="only twinattn-bench --quick's cases")
    group.addoption("--bench-time", type=float, default=2.0, help="seconds of timed rounds per test (default 2)")
    group.addoption(
        "--bench-max-call", type=float, default=10.0, help="skip a test whose call is estimated to take longer (10 s)"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    config = metafunc.config
    try:
        if "case" in metafunc.fixturenames:
            cases = suite.standard_suite(twinattn.get_num_threads())
            chosen = suite.select(cases, config.getoption("--bench-cases"), config.getoption("--bench-quick"))
            metafunc.parametrize("case", chosen, ids=[c.name for c in chosen], scope="session")
        if "backend" in metafunc.fixturenames:
            spec = config.getoption("--bench-backends")
            names = peers.parse_backends(spec, peers.make_runners()) if spec else list(peers.make_runners())
            metafunc.parametrize("backend", names)
    except ValueError as exc:  # the CLI's messages, with these options' names
        message = str(exc).replace("--cases", "--bench-cases").replace("--backends", "--bench-backends")
        raise pytest.UsageError(message) from None


@pytest.fixture(scope="session")
def problem_for() -> Callable[[suite.Case], suite.AnyProblem]:
    """The inputs of a case and their reference, made once (only the latest case is kept)."""
    latest: dict[str, suite.AnyProblem] = {}

    def get(case: suite.Case) -> suite.AnyProblem:
        if case.name not in latest:
            latest.clear()
            latest[case.name] = suite.make_problem(case)
        return latest[case.name]

    return get


@pytest.fixture(scope="session")
def rates() -> timing.Rates:
    return timing.Rates()
