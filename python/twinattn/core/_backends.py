"""Which ports are built, and what they were built with."""

from __future__ import annotations

import importlib
import platform
from types import ModuleType
from typing import Any

import numpy as np

from ._threads import get_num_threads
from .._version import __version__

NATIVE_PORTS = ("cpp", "rust")
BACKENDS = ("auto", "cpp", "rust", "numpy")

_HOW_TO_BUILD = {
    "cpp": "reinstall twinattn from source with a C++17 compiler and CMake: pip install .",
    "rust": (
        "reinstall twinattn from source with Rust's cargo on PATH (https://rustup.rs): "
        "pip install . (a build with --config-settings=cmake.define.TWINATTN_RUST=OFF leaves it out)"
    ),
}

_modules: dict[str, ModuleType | None] = {}
_errors: dict[str, str] = {}
# A port that is built but failed to load (TWINATTN_ISA naming an instruction set it cannot run,
# say): its ImportError message, raised again by every call that needs the port.
_refusals: dict[str, str] = {}


class BackendUnavailableError(RuntimeError):
    """A native port was asked for that this installation does not have."""


def _load(port: str) -> ModuleType | None:
    """The port's module; None when it is not built; ImportError when it is built but refuses
    to load.

    Both native modules raise the same ImportError at import for a bad TWINATTN_ISA (naming the
    variable, the value and the instruction sets available): a user who set one gets that error
    from every call that needs the port, never a silently missing port.
    """
    if port not in _modules and port not in _refusals:
        try:
            _modules[port] = _follow_first_port(importlib.import_module(f"twinattn._{port}"))
        except ModuleNotFoundError as exc:
            _modules[port] = None
            _errors[port] = str(exc)
        except ImportError as exc:
            _refusals[port] = str(exc)
    if port in _refusals:
        raise ImportError(_refusals[port])
    return _modules[port]


def _follow_first_port(module: ModuleType) -> ModuleType:
    """The module, running the default instruction set of the port loaded before it, if any.

    Each port chooses its default alone, and where bfloat16 has two paths (VDPBF16PS or
    conversion to float32, docs/kernels.md) it chooses by timing its two units once. The two
    timings can only disagree on a CPU whose units are about equally fast, but then the ports'
    bfloat16 results would differ; so in a process that holds both, the second follows the first.
    A module whose instruction set was already switched (set_isa) is left as it is.
    """
    first = next((m for m in _modules.values() if m is not None), None)
    if first is not None:
        mine, theirs = module.build_info(), first.build_info()["isa_default"]
        if mine["isa"] == mine["isa_default"] != theirs and theirs in mine["isa_available"]:
            module.set_isa(theirs)
    return module


def native_module(port: str) -> ModuleType:
    """The native module of a port, or BackendUnavailableError saying how to build it."""
    module = _load(port)
    if module is None:
        raise BackendUnavailableError(
            f"backend={port!r} is not available in this installation "
            f"({_errors.get(port, 'not built')}); to build it, {_HOW_TO_BUILD[port]}"
        )
    return module


def backends() -> list[str]:
    """The backends this installation can run, fastest native port first.

    Raises ImportError when a built port refuses to load (TWINATTN_ISA naming an instruction set
    it cannot run).
    """
    return [port for port in NATIVE_PORTS if _load(port) is not None] + ["numpy"]


def resolve_backend(backend: object) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if backend == "auto":
        return backends()[0]
    return backend


def build_info() -> dict[str, Any]:
    """Per port: available or not, the instruction set chosen at run time, threads, compiler."""
    info: dict[str, Any] = {"version": __version__, "machine": platform.machine()}
    threads = get_num_threads()
    for port in NATIVE_PORTS:
        module = _load(port)
        if module is None:
            info[port] = {"available": False, "error": _errors.get(port, "not built")}
        else:
            info[port] = {"available": True, **module.build_info(), "threads": threads}
    info["numpy"] = {"available": True, "isa": "numpy", "version": np.__version__, "threads": 1}
    return info
