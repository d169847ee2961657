"""The two ports mirror each other file for file (scripts/check_twins.py, docs/kernels.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_twins", ROOT / "scripts" / "check_twins.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


twins = _load_checker()


def _pair_id(pair: tuple[list[str], list[str]]) -> str:
    return Path(pair[1][0]).stem


@pytest.mark.parametrize("pair", twins.PAIRS, ids=_pair_id)
def test_twin_pair_declares_the_same_names(pair: tuple[list[str], list[str]]) -> None:
    assert twins.check(pairs=[pair]) == []


def test_every_native_source_is_paired() -> None:
    paired = {path for cpp, rust in twins.PAIRS for path in cpp + rust}
    sources = [
        *ROOT.glob("cpp/src/*.[ch]pp"),
        *ROOT.glob("cpp/include/twinattn/*.hpp"),
        *ROOT.glob("cpp/python/*.cpp"),
        *ROOT.glob("rust/src/*.rs"),
    ]
    unpaired = sorted(
        str(path.relative_to(ROOT)) for path in sources
        if str(path.relative_to(ROOT)) not in paired | set(twins.ONE_SIDED)
    )
    assert unpaired == []
    assert not list(ROOT.glob("rust/src/*/*.rs")), "a Rust module in a subfolder has no C++ twin name"


def test_the_checker_sees_a_name_on_one_side() -> None:
    cpp = "namespace twinattn {\nconstexpr int64_t kKeyBlock = 256;\nstruct WorkItem { int64_t b, kv_head; };\n" \
          "void attend_rows(const FlashPlan& plan) { if (x) { int y = f(1); } }\n}\n"
    rust = "pub const KEY_BLOCK: usize = 256;\npub struct WorkItem { pub b: usize }\n" \
           "fn attend_rows(plan: &FlashPlan) { let y = f(1); }\n#[cfg(test)]\nmod tests { fn t() {} }\n"
    cpp_names = twins.cpp_names(cpp)
    rust_names = twins.rust_names(rust)
    assert {"KEY_BLOCK", "WorkItem", "WorkItem.b", "attend_rows"} <= cpp_names & rust_names
    assert cpp_names - rust_names == {"WorkItem.kv_head"}
    assert rust_names - cpp_names == set()
