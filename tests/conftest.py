"""One `backend` fixture runs every semantic test on numpy, cpp and rust.

A port that is not built is skipped with the reason, unless TWINATTN_REQUIRE_BACKENDS names it
(the test command sets TWINATTN_REQUIRE_BACKENDS=cpp,rust, so a missing port fails CI instead of
vanishing into skips). Likewise an optional library (torch, transformers) that is not installed
skips the tests that need it, unless TWINATTN_REQUIRE_OPTIONAL names it (the test command sets
TWINATTN_REQUIRE_OPTIONAL=torch,transformers).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from types import ModuleType

import pytest

import twinattn

ALL_BACKENDS = ("numpy", "cpp", "rust")
NATIVE_BACKENDS = ("cpp", "rust")


def _named_in(variable: str) -> set[str]:
    return {name.strip() for name in os.environ.get(variable, "").split(",") if name.strip()}


def _require(port: str) -> None:
    if port in twinattn.backends():
        return
    required = _named_in("TWINATTN_REQUIRE_BACKENDS")
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


def optional_required(name: str) -> bool:
    """Whether TWINATTN_REQUIRE_OPTIONAL says the tests needing library `name` must run."""
    return name in _named_in("TWINATTN_REQUIRE_OPTIONAL")


def require_package(name: str, how: str) -> None:
    """For a test that needs the package importable as `name` (found without importing it): absent,
    it skips the test, or fails it when TWINATTN_REQUIRE_OPTIONAL names it; `how` installs it."""
    if importlib.util.find_spec(name) is None:
        reason = f"the package {name!r} is not installed: {how}"
        if optional_required(name):
            pytest.fail(f"{reason}; TWINATTN_REQUIRE_OPTIONAL requires it", pytrace=False)
        pytest.skip(reason)


def import_optional(name: str, purpose: str) -> ModuleType:
    """Imports an optional library for a test module: missing, it skips the module with the reason,
    or fails it when TWINATTN_REQUIRE_OPTIONAL names it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # import-time deprecation notices are not the tests' subject
            return importlib.import_module(name)
    except ImportError as exc:
        reason = f"{name} is not installed (optional: {purpose}): {exc}"
        if optional_required(name):
            pytest.fail(f"{reason}; TWINATTN_REQUIRE_OPTIONAL requires it", pytrace=False)
        pytest.skip(reason, allow_module_level=True)
