#!/usr/bin/env python3
"""Checks that the C++ and Rust ports mirror each other file for file (docs/kernels.md, "Files").

For each twin pair (C++ files <-> Rust files) it lists the names each side declares at file,
namespace, class or impl scope: functions and methods, types, constants, struct fields (as
Type.field) and enum values, in each language's case (C++ kKeyBlock is Rust KEY_BLOCK, a C++
member next_item_ is Rust next_item). It fails when a name is on one side only, unless FORCED
lists it with the reason the language forces it (and fails on a FORCED entry that no longer
differs, so the list cannot go stale). Names inside function bodies, Rust's #[cfg(test)] modules
and comments do not count.

    python scripts/check_twins.py            # exit status 1 and the differences when they drift
    python scripts/check_twins.py --list     # every pair's names, side by side
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (C++ files, Rust files). Every C++ source and every Rust module is in exactly one pair or in
# ONE_SIDED below (tests/test_twins.py checks that too).
PAIRS: list[tuple[list[str], list[str]]] = [
    (["cpp/include/twinattn/constants.hpp"], ["rust/src/constants.rs"]),
    (["cpp/src/thread_pool.hpp", "cpp/src/thread_pool.cpp"], ["rust/src/thread_pool.rs"]),
    (["cpp/src/simd_scalar.hpp"], ["rust/src/simd_scalar.rs"]),
    (["cpp/src/simd_avx2.hpp"], ["rust/src/simd_avx2.rs"]),
    (["cpp/src/simd_avx512.hpp"], ["rust/src/simd_avx512.rs"]),
    (["cpp/src/simd_neon.hpp"], ["rust/src/simd_neon.rs"]),
    (["cpp/src/element.hpp"], ["rust/src/element.rs"]),
    (["cpp/src/flash_kernel.hpp"], ["rust/src/flash_kernel.rs"]),
    (["cpp/src/flash_scalar.cpp"], ["rust/src/flash_scalar.rs"]),
    (["cpp/src/flash_avx2.cpp"], ["rust/src/flash_avx2.rs"]),
    (["cpp/src/flash_avx512.cpp"], ["rust/src/flash_avx512.rs"]),
    (["cpp/src/flash_neon.cpp"], ["rust/src/flash_neon.rs"]),
    (["cpp/src/flash_avx512bf16.cpp"], ["rust/src/flash_avx512bf16.rs"]),
    (["cpp/include/twinattn/flash_attention.hpp", "cpp/src/flash_attention.cpp"],
     ["rust/src/flash_attention.rs"]),
    (["cpp/src/measure_peak.hpp", "cpp/src/measure_peak.cpp"], ["rust/src/measure_peak.rs"]),
    (["cpp/src/dispatch.hpp", "cpp/src/dispatch.cpp"], ["rust/src/dispatch.rs"]),
    (["cpp/include/twinattn/reference_kernel.hpp", "cpp/src/reference_kernel.cpp"],
     ["rust/src/reference_kernel.rs"]),
    (["cpp/include/twinattn/problem.hpp", "cpp/src/problem.cpp"], ["rust/src/problem.rs"]),
    (["cpp/python/bindings.cpp"], ["rust/src/python.rs"]),
]

# Files with no twin, and why.
ONE_SIDED = {
    # C++ templates are duck-typed; Rust states the vector operations as a trait.
    "rust/src/simd.rs": "the Vector trait (C++ templates need none)",
    # Rust has no inheritance: the ops that are one intrinsic each on both x86 types are a macro
    # both impls expand (C++ writes them in each header).
    "rust/src/simd_x86.rs": "the x86 vector types' shared one-intrinsic ops (a macro)",
    # C++ shares the 16-bit loads through a CRTP base; Rust through the Load / Element traits of
    # element.rs and the Vector trait's default methods.
    "cpp/src/simd_storage.hpp": "the storage loads the vector types share (CRTP base)",
    "rust/src/lib.rs": "the crate root: module list",
}

# Names a language forces onto one side only: {pair's first C++ file: {name: why}}.
FORCED: dict[str, dict[str, str]] = {
    "cpp/src/thread_pool.hpp": {
        # Rust: the job closure's pointer must be wrapped to cross threads (raw pointers are not
        # Send); C++ stores it as it is.
        "JobFn": "raw pointer wrapper (Send)",
        # Rust: Mutex<State> holds what C++ guards by hand with state_mutex_ beside the fields.
        "State": "the fields behind the Mutex (C++: members guarded by state_mutex_)",
        "lock": "a poisoned Mutex is recovered (C++ mutexes do not poison)",
    },
}

# ---- extraction ---------------------------------------------------------------------------------

CPP_KEYWORDS = {
    "if", "for", "while", "switch", "return", "sizeof", "static_assert", "decltype", "alignof",
    "catch", "throw", "new", "delete", "operator", "defined", "__attribute__", "alignas",
    "noexcept", "static_cast", "reinterpret_cast", "const_cast", "PYBIND11_MODULE",
}


def strip_cpp(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'R"\((.*?)\)"', '""', text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)
    text = re.sub(r"'(?:\\.|[^'\\\n])'", "' '", text)
    text = re.sub(r"^[ \t]*#[^\n]*(?:\\\n[^\n]*)*", "", text, flags=re.M)
    text = re.sub(r"__attribute__\s*\(\(.*?\)\)", " ", text)
    return text.replace("__extension__", " ")


def strip_rust(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'r#*"(.*?)"#*', '""', text, flags=re.S)
    text = re.sub(r'b?"(?:\\.|[^"\\])*"', '""', text)
    text = re.sub(r"b?'(?:\\.|[^'\\\n])'", "' '", text)
    # #[cfg(test)] mod tests { ... } (tests belong to rust/tests; none should be left inline)
    return re.sub(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", "mod __tests {", text)


def split_top(text: str, sep: str = ",") -> list[str]:
    """Splits at `sep` outside (), [], {} and <>."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def scopes(text: str):
    """Yields (scope kind, scope name, statement header, ends with '{') for every statement at
    every scope; the caller keeps those it wants."""
    stack: list[tuple[str, str]] = [("ns", "")]
    header_start = 0
    depth = 0  # inside () or []: a ; or { there ends nothing (Rust's [T; 3], C++ lambdas' bodies)
    i = 0
    while i < len(text):
        ch = text[i]
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch in ";{}" and depth == 0:
            header = text[header_start:i].strip()
            kind, name = stack[-1]
            if ch == ";":
                yield kind, name, header, False
            elif ch == "{":
                yield kind, name, header, True
                stack.append(classify(header, kind))
            else:
                if header:
                    yield kind, name, header, False
                stack.pop()
                if not stack:
                    stack.append(("ns", ""))
            header_start = i + 1
        i += 1


def classify(header: str, outer: str) -> tuple[str, str]:
    if outer in ("body", "enum", "init"):
        return ("body", "")
    h = re.sub(r"#!?\[[^\]]*\]", " ", header)
    h = re.sub(r"^template\s*<.*?>\s*", "", h.strip(), flags=re.S)
    if re.match(r"(pub(\([^)]*\))?\s+)?mod\s+__tests$", h):
        return ("body", "")
    if re.match(r"^(inline\s+)?namespace\b", h) or re.match(r'^extern\s+""$', h):
        return ("ns", "")
    if re.match(r"^(pub(\([^)]*\))?\s+)?mod\s+\w+$", h):
        return ("ns", "")
    m = re.match(r"^(?:pub(?:\([^)]*\))?\s+)?(?:unsafe\s+)?impl\b.*?(\w+)(?:<[^{]*>)?$", h, re.S)
    if m:
        return ("class", "")
    m = re.match(r"^(?:pub(?:\([^)]*\))?\s+)?(?:unsafe\s+)?trait\s+(\w+)", h)
    if m:
        return ("class", m.group(1))
    m = re.match(r"^(?:pub(?:\([^)]*\))?\s+)?(?:struct|union)\s+(\w+)", h)
    if m and "(" not in h:
        return ("struct", m.group(1))
    m = re.match(r"^(?:struct|class)\s+(\w+)", h)
    if m and "(" not in h:
        return ("struct", m.group(1))
    if re.match(r"^(?:pub(?:\([^)]*\))?\s+)?enum\b", h) or re.match(r"^enum\b", h):
        m = re.search(r"enum\s+(?:class\s+)?(\w+)", h)
        return ("enum", m.group(1) if m else "")
    if "(" not in h and re.search(r"(=|\w|\])\s*$", h) and outer in ("ns", "class", "struct"):
        return ("init", "")
    return ("body", "")


def cpp_const_name(name: str) -> str:
    if re.match(r"^k[A-Z0-9]", name):
        core = name[1:].replace("NaN", "Nan")
        core = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", core)
        return core.upper()
    return name


def cpp_names(text: str) -> set[str]:
    names: set[str] = set()
    text = strip_cpp(text)
    for kind, owner, header, opens in scopes(text):
        if kind not in ("ns", "struct", "class", "enum"):
            continue
        h = re.sub(r"^template\s*<.*?>\s*", "", header, flags=re.S).strip()
        h = re.sub(r"^(public|private|protected)\s*:\s*", "", h)
        if not h or h.startswith(("using namespace", "friend", "return")):
            continue
        if kind == "enum":
            for value in split_top(h):
                m = re.match(r"\s*(\w+)", value)
                if m:
                    names.add(f"{owner}.{m.group(1)}" if owner else m.group(1))
            continue
        m = re.match(r"^using\s+(\w+)\s*=", h)
        if m:
            names.add(m.group(1))
            continue
        m = re.match(r"^typedef\b.*?(\w+)\s*;?$", h, re.S)
        if m:
            names.add(m.group(1))
            continue
        m = re.match(r"^(?:struct|class|enum(?:\s+class)?|union)\s+(\w+)", h)
        if m and "(" not in h.split("=")[0]:
            names.add(m.group(1))
            continue
        if h.startswith(("static_assert", "namespace", "extern")):
            continue
        decl = h.split("=")[0]
        call = re.search(r"([~\w]+)\s*\(", decl)
        if call and call.group(1) not in CPP_KEYWORDS:
            name = call.group(1)
            if name == owner or name.startswith("~") or name.startswith("operator"):
                continue  # constructors, destructors, operators
            if kind == "ns" and not opens:
                continue  # a prototype: the definition (in the twin's file) is what counts
            names.add(name.rstrip("_"))
            continue
        if call:
            continue
        # fields, variables, constants: the last identifier of each declarator
        head = re.sub(r"\{.*$", "", h, flags=re.S)
        parts = split_top(head)
        for index, part in enumerate(parts):
            part = re.sub(r"\[.*?\]", "", part.split("=")[0]).strip()
            m = re.search(r"(\w+)\s*$", part)
            if not m or (index == 0 and not re.search(r"[\w>*&\]]\s+[*&]*\w+\s*$", part)):
                continue
            name = cpp_const_name(m.group(1)).rstrip("_")
            member = kind == "struct" and not re.match(r"(static|constexpr)\b", h)
            names.add(f"{owner}.{name}" if member else name)
    return names


RUST_ITEM = re.compile(
    r"^(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?(?:(?:const|unsafe|extern\s+\"\")\s+)*"
    r"(fn|struct|enum|trait|type|const|static|macro_rules!|union)\s*(\w+)"
)


def rust_names(text: str) -> set[str]:
    names: set[str] = set()
    text = strip_rust(text)
    for kind, owner, header, opens in scopes(text):
        h = re.sub(r"#!?\[[^\]]*\]", " ", header).strip()
        if kind == "struct":
            for part in split_top(h):
                m = re.match(r"\s*(?:pub(?:\([^)]*\))?\s+)?(\w+)\s*:", part)
                if m:
                    names.add(f"{owner}.{m.group(1)}")
            continue
        if kind == "enum":
            for part in split_top(h):
                m = re.match(r"\s*(\w+)", part)
                if m:
                    names.add(f"{owner}.{m.group(1)}")
            continue
        if kind not in ("ns", "class"):
            continue
        for statement in [h]:
            m = RUST_ITEM.match(statement)
            if m:
                names.add(m.group(2))
            # an item-generating macro of this crate: its first argument is the table it defines
            m = re.search(r"make_kernels!\s*\(\s*(\w+)", statement)
            if m:
                names.add(m.group(1))
    return names


def names_of(paths: list[str], extract) -> set[str]:
    names: set[str] = set()
    for path in paths:
        names |= extract((ROOT / path).read_text())
    return names


def check(list_all: bool = False) -> list[str]:
    problems: list[str] = []
    for cpp_files, rust_files in PAIRS:
        cpp = names_of(cpp_files, cpp_names)
        rust = names_of(rust_files, rust_names)
        forced = FORCED.get(cpp_files[0], {})
        label = f"{' + '.join(cpp_files)} <-> {' + '.join(rust_files)}"
        if list_all:
            print(label)
            for name in sorted(cpp | rust):
                side = "both" if name in cpp and name in rust else "C++ " if name in cpp else "Rust"
                print(f"  {side}  {name}")
        for name in sorted(cpp - rust):
            if name not in forced:
                problems.append(f"{label}: {name} only in C++")
        for name in sorted(rust - cpp):
            if name not in forced:
                problems.append(f"{label}: {name} only in Rust")
        for name in sorted(forced):
            if (name in cpp) == (name in rust):
                problems.append(f"{label}: FORCED lists {name}, which is no longer one-sided")
    return problems


def main() -> int:
    problems = check(list_all="--list" in sys.argv)
    for problem in problems:
        print(problem)
    print(f"{len(problems)} difference(s) between the twins")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
