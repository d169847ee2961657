"""One `backend` fixture runs every semantic test on numpy, cpp and rust.

A port that is not built is skipped with the reason, unless TWINATTN_REQUIRE_BACKENDS names it
(the test command sets TWINATTN_REQUIRE_BACKENDS=cpp,rust, so a missing port fails CI instead of
vanishing into skips).
"""

from __future__ import annotations

import os

import pytest

import twinattn

ALL_BACKENDS = ("numpy", "cpp", "rust")
NATIVE_BACKENDS = ("cpp", "rust")


def _require(port: str) -> None:
    if port in twinattn.backends():
        return
    required = {p.strip() for p in os.environ.get("TWINATTN_REQUIRE_BACKENDS", "").split(",") if p.strip()}
    reason = twinattn.build_info()[port].get("error", "not built")
    if port in required:
        pytest.fail(f"backend {port!r} is required (TWINATTN_REQUIRE_BACKENDS) but not available: {reason}")
    pytest.skip(f"backend {port!r} not built: {reason}")


@pytest.fixture(params=ALL_BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param != "numpy":
        _require(request.param)
    return request.param


@pytest.fixture(params=NATIVE_BACKENDS)
def native_backend(request: pytest.FixtureRequest) -> str:
    _require(request.param)
    return request.param
