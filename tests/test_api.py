"""The package surface: backends, build info, threads, version."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import numpy as np
import pytest

import twinattn
from conftest import _require

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_backends_lists_numpy_last() -> None:
    names = twinattn.backends()
    assert names[-1] == "numpy"
    assert set(names) <= {"cpp", "rust", "numpy"}


def test_build_info_per_port() -> None:
    info = twinattn.build_info()
    assert info["version"] == twinattn.__version__
    for port in twinattn.backends():
        entry = info[port]
        assert entry["available"] is True
        if port != "numpy":
            assert entry["threads"] == twinattn.get_num_threads()
            assert entry["isa"] in entry["isa_available"]
            assert entry["version"] == twinattn.__version__
            assert entry["compiler"]


def test_unavailable_backend_says_how_to_build(monkeypatch: pytest.MonkeyPatch) -> None:
    from twinattn.core import _backends

    monkeypatch.setitem(_backends._modules, "rust", None)
    monkeypatch.setitem(_backends._errors, "rust", "No module named 'twinattn._rust'")
    assert "rust" not in twinattn.backends()
    assert twinattn.build_info()["rust"]["available"] is False
    q = np.zeros((1, 2, 2), np.float32)
    with pytest.raises(twinattn.BackendUnavailableError, match="cargo"):
        twinattn.attention(q, q, q, backend="rust")


def test_auto_picks_a_native_port_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto runs the first built native port (cpp, then rust), never numpy while one is built.

    The native module that auto calls is watched (its real attention_forward still runs), and the
    result must be the bits of that port's own call, which differ from numpy's float64-then-cast.
    """
    from twinattn.core._backends import NATIVE_PORTS, native_module

    built = [port for port in NATIVE_PORTS if port in twinattn.backends()]
    if not built:
        _require(NATIVE_PORTS[0])  # fails under TWINATTN_REQUIRE_BACKENDS, else skips visibly
    expected = built[0]
    assert twinattn.backends()[0] == expected
    calls: list[str] = []
    for port in built:
        module = native_module(port)

        def spy(*args: Any, _port: str = port, _real: Any = module.attention_forward, **kwargs: Any) -> Any:
            calls.append(_port)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, "attention_forward", spy)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 37, 24)).astype(np.float32) for _ in range(3))
    auto = twinattn.attention(q, k, v, backend="auto")
    assert calls == [expected]
    np.testing.assert_array_equal(auto, twinattn.attention(q, k, v, backend=expected))
    numpy = twinattn.attention(q, k, v, backend="numpy")
    assert not np.array_equal(auto, numpy), "numpy's result has the same bits: this input cannot tell them apart"
    np.testing.assert_allclose(auto, numpy, rtol=1e-5, atol=1e-6)


def test_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TWINATTN_NUM_THREADS", raising=False)
    default = twinattn.get_num_threads()
    assert default >= 1
    monkeypatch.setenv("TWINATTN_NUM_THREADS", "3")
    assert twinattn.get_num_threads() == 3
    twinattn.set_num_threads(5)
    try:
        assert twinattn.get_num_threads() == 5
        with pytest.raises(ValueError, match="n: expected a positive int"):
            twinattn.set_num_threads(0)
    finally:
        twinattn.set_num_threads(None)
    monkeypatch.setenv("TWINATTN_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="TWINATTN_NUM_THREADS"):
        twinattn.get_num_threads()


def test_versions_agree() -> None:
    cargo = (ROOT / "rust" / "Cargo.toml").read_text()
    match = re.search(r'^version\s*=\s*"([^"]+)"', cargo, re.M)
    assert match and match.group(1) == twinattn.__version__


def test_main_job_runs() -> None:
    from twinattn.__main__ import main

    assert main(["--seq-len", "64", "--repeat", "1"]) == 0
