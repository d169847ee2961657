"""pytest-benchmark suites over twinattn-bench's cases and backends.

    pytest benchmarks/ --benchmark-only                       # the standard suite, every backend
    pytest benchmarks/ --benchmark-only --bench-quick         # twinattn-bench --quick's cases
    pytest benchmarks/ --benchmark-only --bench-cases decode --bench-backends cpp,rust

Cases, inputs, checks and backends are twinattn.bench's own, so these numbers and the CLI's agree.
Each test is one (case, backend), in the group of its case; extra_info carries GFLOP/s and GB/s.
Not part of the test command CI runs (pyproject's testpaths is tests/).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import twinattn
from twinattn.bench import cases as bench_cases
from twinattn.bench import measure, runners


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("twinattn-bench")
    group.addoption("--bench-cases", default=None, help="cases, groups or globs, as twinattn-bench --cases")
    group.addoption("--bench-backends", default=None, help="backends, as twinattn-bench --backends")
    group.addoption("--bench-quick", action="store_true", help="only twinattn-bench --quick's cases")
    group.addoption("--bench-time", type=float, default=2.0, help="seconds of timed rounds per test (default 2)")
    group.addoption(
        "--bench-max-call",
        type=float,
        default=10.0,
        help="skip a test whose single call is estimated to take longer (default 10 s)",
    )


RUNNERS = runners.make_runners()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    config = metafunc.config
    if "case" in metafunc.fixturenames:
        suite = bench_cases.standard_suite(twinattn.get_num_threads())
        try:
            chosen = bench_cases.select(suite, config.getoption("--bench-cases"), config.getoption("--bench-quick"))
        except ValueError as exc:
            raise pytest.UsageError(str(exc).replace("--cases", "--bench-cases")) from None
        metafunc.parametrize("case", chosen, ids=[c.name for c in chosen], scope="session")
    if "backend" in metafunc.fixturenames:
        spec = config.getoption("--bench-backends")
        try:
            names = runners.parse_backends(spec, RUNNERS) if spec else list(RUNNERS)
        except ValueError as exc:
            raise pytest.UsageError(str(exc).replace("--backends", "--bench-backends")) from None
        metafunc.parametrize("backend", names)


@pytest.fixture(scope="session")
def problem_for() -> Callable[[bench_cases.Case], tuple[Any, Any]]:
    """The inputs and reference rows of a case, made once (only the latest case is kept)."""
    cache: dict[str, tuple[Any, Any]] = {}

    def get(case: bench_cases.Case) -> tuple[Any, Any]:
        if case.name not in cache:
            cache.clear()
            problem = bench_cases.make_problem(case)
            cache[case.name] = (problem, measure.expected_rows(problem))
        return cache[case.name]

    return get


@pytest.fixture(scope="session")
def rates() -> measure.Rates:
    return measure.Rates()
