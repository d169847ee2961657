"""Every ```python block of README.md runs on its own: alone, in a fresh interpreter, with nothing
defined by the blocks above it.

A block that imports torch, transformers or twinattn.models needs those packages (and the model
packages of the models it loads): absent, the block is skipped, or failed where
TWINATTN_REQUIRE_OPTIONAL names them (the test command does); see conftest.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import NATIVE_BACKENDS, _require, require_package

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)

# what a block's imports need beyond twinattn, as (import name, how to install it)
TORCH = ("torch", "pip install torch")
TRANSFORMERS = ("transformers", "pip install transformers")
NEEDS = {
    "torch": [TORCH],
    "twinattn.torch": [TORCH],
    "twinattn.flash": [TORCH],
    "twinattn.hf": [TORCH, TRANSFORMERS],
    "twinattn.models": [TORCH, TRANSFORMERS, ("gguf", "pip install gguf"), ("accelerate", "pip install accelerate")],
}


def _blocks() -> list[tuple[int, str]]:
    """(line number, code) of each ```python block."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def _needs(code: str) -> list[tuple[str, str]]:
    import twinattn.models as models  # the model packages, by the names load() takes

    imported = set(re.findall(r"^\s*(?:import|from)\s+([\w.]+)", code, re.M))
    needs = [need for name in sorted(imported) for need in NEEDS.get(name, [])]
    for name in re.findall(r"twinattn\.models\.load\(\s*\"(\w+)\"", code):
        needs.append((models.MODELS[name].package, models.MODELS[name].install))
    return list(dict.fromkeys(needs))


def test_readme_has_the_blocks() -> None:
    blocks = _blocks()
    assert len(blocks) >= 5 and any("twinattn.hf" in code for _, code in blocks)


@pytest.mark.parametrize("line, code", _blocks(), ids=lambda x: f"line{x}" if isinstance(x, int) else "")
def test_each_python_block_runs_on_its_own(line: int, code: str) -> None:
    for port in NATIVE_BACKENDS:  # the examples name both ports
        _require(port)
    for name, how in _needs(code):
        require_package(name, how)
    package = str(Path(__import__("twinattn").__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package, os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, f"README.md line {line}:\n{code}\n{run.stderr[-3000:]}"
