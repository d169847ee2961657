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
    (["cpp/src/flash_avx512bf16.cpp", "cpp/src/flash_bf16_pairs.hpp"], ["rust/src/flash_avx512bf16.rs"]),
    (["cpp/src/flash_amx.cpp"], ["rust/src/flash_amx.rs", "rust/src/amx_usable.rs"]),
    (["cpp/include/twinattn/flash_attention.hpp", "cpp/src/flash_attention.cpp"],
     ["rust/src/flash_attention.rs"]),
    (["cpp/include/twinattn/flash_backward.hpp", "cpp/src/flash_backward.cpp"],
     ["rust/src/flash_backward.rs"]),
    (["cpp/src/backward_kernel.hpp"], ["rust/src/backward_kernel.rs"]),
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
_NO_OVERLOADS = "Rust has no overloading: one name per storage type (C++ overloads one name)"
_TRAIT = "Rust states a generic parameter's operations as a trait (C++ templates need none)"
_SYNC = "raw pointers are neither Send nor Sync in Rust: a wrapper shares them across threads"
_NEWTYPE = "Rust wraps the register in a newtype to implement Vector (C++ uses the register, Reg)"
_STD = "the Rust standard library has it (f32::NEG_INFINITY, i128, div_ceil, to_bits)"
_CLASS = "C++ groups a kernel's functions in a class template over V, T, KV; Rust writes generic functions"
_STATE = "Rust keeps the fields a mutex guards inside Mutex<State>; C++ keeps them beside state_mutex_"
_ERROR = "Rust returns errors as Result<_, ProblemError>; C++ throws std::invalid_argument / std::bad_alloc"
_NO_NEST = "C++ cannot define a function inside a function: the 4-lane halves are static members (Rust: local fns)"
FORCED: dict[str, dict[str, str]] = {
    "cpp/src/thread_pool.hpp": {
        "JobFn": _SYNC,
        "State": _STATE,
        **{f"State.{f}": _STATE for f in ("generation", "items", "job", "panic", "pending", "wanted", "workers")},
        **{f"ThreadPool.{f}": _STATE for f in ("error", "fn", "generation", "items", "job_mutex", "pending",
                                               "state_mutex", "wanted", "workers", "job", "state")},
        "lock": "a Rust Mutex is poisoned by a panic; lock() recovers it (C++ mutexes do not poison)",
    },
    "cpp/src/simd_scalar.hpp": {"Reg": _NEWTYPE, "Reg.lane": _NEWTYPE, "load_as_f32": _NO_OVERLOADS,
                                "load_tail_as_f32": _NO_OVERLOADS, "store_from_f32": _NO_OVERLOADS,
                                "store_tail_from_f32": _NO_OVERLOADS,
                                "map2": "lane-wise helper: C++ writes the loops inline",
                                "W": "the width as a const (C++: VecScalar::kWidth)"},
    **{f"cpp/src/simd_{isa}.hpp": {"Reg": _NEWTYPE, "load_as_f32": _NO_OVERLOADS, "store_from_f32": _NO_OVERLOADS,
                                   "load_f16": _NO_OVERLOADS, "load_bf16": _NO_OVERLOADS,
                                   "load_i8": _NO_OVERLOADS, "store_f16": _NO_OVERLOADS,
                                   "store_bf16": _NO_OVERLOADS}
       for isa in ("avx2", "avx512")},
    "cpp/src/simd_neon.hpp": {"Reg": _NEWTYPE, "Reg.hi": _NEWTYPE, "Reg.lo": _NEWTYPE,
                              "load_as_f32": _NO_OVERLOADS, "store_from_f32": _NO_OVERLOADS,
                              "load_i8": _NO_OVERLOADS, "exp2_4": _NO_NEST},
    "cpp/src/element.hpp": {
        "Float16.bits": "Rust: a tuple struct Float16(u16)", "BFloat16.bits": "Rust: a tuple struct BFloat16(u16)",
        "float_bits": _STD, "bits_float": _STD,
        "f16_to_f32": _NO_OVERLOADS, "bf16_to_f32": _NO_OVERLOADS,
        "Load": _TRAIT, "Element": _TRAIT, "ZERO": _TRAIT, "SCALED": _TRAIT, "DTYPE": _TRAIT,
        "MAX_LANES": _TRAIT, "load": _TRAIT, "load_tail": _TRAIT, "store": _TRAIT, "store_tail": _TRAIT,
    },
    "cpp/src/flash_kernel.hpp": {
        "Kernel": _CLASS, "Reg": _CLASS, "W": _CLASS, "INT8": _CLASS,
        "NEG_INF": _STD, "INF": _STD, "NAN": _STD,
        "MAX_VECTORS": "stable Rust cannot size an array by a generic parameter's constant",
        "MAX_WIDTH": "stable Rust cannot size an array by a generic parameter's constant",
        "at": "strided offsets need usize -> i64 -> isize casts in Rust; C++ multiplies inline",
        "match_strip_rows": "a const generic from a run-time strip height (C++: a switch at the call)",
        "Values": _TRAIT, "Elem": _TRAIT,
        "ValueRows.element": "Rust: a generic struct must use its type parameter (PhantomData)",
        "new": "Rust: ValueRows's constructor fills its PhantomData (C++: ValueRows{rows, 0})",
    },
    "cpp/src/flash_avx512bf16.cpp": {
        "Convert": _CLASS, "DotKernel": _CLASS, "PairKernel": _CLASS, "PairProducts": _TRAIT,
    },
    "cpp/src/flash_amx.cpp": {
        "AmxKernel": _CLASS, "DotKernel": _CLASS,
        "TileConfig": "Rust: the 64 bytes as one array (C++ a struct of LDTILECFG's fields)",
        "tile_config": "Rust builds the configuration as a const (TILE_CONFIG); C++ in a function",
        "TILE_CONFIG": "Rust builds the configuration as a const (TILE_CONFIG); C++ in a function",
        **{name: "core::arch's AMX intrinsics are unstable: Rust wraps each tile instruction in inline asm "
                 "(C++ calls the _tile_* intrinsics)"
           for name in ("tile_dot", "tile_load", "tile_load_config", "tile_release", "tile_store", "tile_zero")},
    },
    "cpp/include/twinattn/flash_attention.hpp": {
        "AlignedBuffer.operator": "C++ deletes the copy; Rust types do not copy unless they say so",
        "layout": "Rust frees with the Layout it allocated with (C++ free() needs none)",
        "release": "Rust frees with the Layout it allocated with (C++ free() needs none)",
        "ceil_div": _STD, "int128": _STD,
        "max_nan": "C++ cannot share flash_kernel.hpp's (ODR note there); Rust imports it",
        "thread_scratch": "C++ thread_local function statics; Rust thread_local! with RefCell borrows",
        "caller_buffers": "C++ thread_local function statics; Rust thread_local! with RefCell borrows",
        "with_scratch": "C++ thread_local function statics; Rust thread_local! with RefCell borrows",
        "with_thread_buffers": "C++ thread_local function statics; Rust thread_local! with RefCell borrows",
        "Shared": _SYNC, "get": _SYNC,
    },
    "cpp/src/backward_kernel.hpp": {
        "Ops": _CLASS, "Reg": _CLASS, "W": _CLASS,
        "ACCUMULATORS": "stable Rust cannot use a generic parameter's constant in a const generic: the chunk is chosen from WIDTH at run time",
        "make_backward_kernels": "Rust's make_kernels macro fills the backward table inline (C++: a template function)",
    },
    "cpp/include/twinattn/flash_backward.hpp": {
        "NEG_INF": _STD, "ceil_div": _STD,
        **{name: "C++ aligns std::vector's storage to 64 bytes through an allocator (the Allocator "
                 "interface); stable Rust's Vec takes no allocator"
           for name in ("LineAllocator", "LineAllocator.operator", "LineVector", "allocate", "deallocate",
                        "value_type")},
        **{name: "Rust owns a 64-byte aligned allocation (std::alloc) and derefs it to a slice, and one "
                 "trait grows it and Vec alike (C++: one std::vector type with an allocator)"
           for name in ("LineVec", "LineVec.data", "LineVec.len", "Target", "deref", "deref_mut", "layout",
                        "release", "Grow")},
        "ScalarKernel": _CLASS,
        "backward_scratch": "C++ thread_local function statics; Rust thread_local! with RefCell borrows",
        "caller_buffers": "C++ thread_local function statics; Rust thread_local! with RefCell borrows",
    },
    "cpp/include/twinattn/reference_kernel.hpp": {
        "NEG_INF": _STD, "int128": _STD, "SharedProblem": _SYNC, "SharedProblem.p": _SYNC, "new": _SYNC,
    },
    "cpp/src/dispatch.hpp": {
        "IsaIndex": "a C++ enum names the indices; Rust names them as consts",
        "CpuSupport": "a C++ function cannot return a C array: a struct wraps it (Rust: [bool; ISA_COUNT])",
        "CpuSupport.isa": "a C++ function cannot return a C array: a struct wraps it (Rust: [bool; ISA_COUNT])",
        "available_list": "Rust joins the names with the standard library's join (C++ has no string join)",
    },
    "cpp/include/twinattn/problem.hpp": {
        "Int64Span": "C++17 has no slice: a pointer and a length (Rust: &[i64])",
        "Int64Span.data": "C++17 has no slice: a pointer and a length (Rust: &[i64])",
        "Int64Span.size": "C++17 has no slice: a pointer and a length (Rust: &[i64])",
        "int128": _STD,
        "float_string": "Rust's Display writes a float's shortest round-trip digits (C++ needs std::to_chars)",
        "element_size": "a C++ enum class has no methods: ElementType's size and name are free functions",
        "element_name": "a C++ enum class has no methods: ElementType's size and name are free functions",
        "size": "a C++ enum class has no methods: ElementType's size and name are free functions",
        "name": "a C++ enum class has no methods: ElementType's size and name are free functions",
        "NONE": "raw pointers have no Default in Rust: each optional view has a NONE const (C++ value-initializes)",
        "ProblemError": _ERROR, "out_of_memory": _ERROR, "is_out_of_memory": _ERROR,
        "try_filled": "Rust's vec! aborts on a failed allocation; C++'s std::vector throws std::bad_alloc",
    },
    "cpp/python/bindings.cpp": {
        "_rust": "PyO3's #[pymodule] is a function; pybind11's PYBIND11_MODULE a macro",
        "compiler_name": "C++ names its compiler from predefined macros; Rust's build.rs passes rustc's version (env!)",
        "dtype_string": "C++ turns the dtype into a std::string to concatenate; Rust's format! prints it",
        "data_of": "rust-numpy's untyped array has no data pointer accessor (C++: py::array::data())",
        "raise": _ERROR,
        "DetachedProblem": "raw pointers are not Send in Rust: a wrapper carries the problem into the GIL-free closure",
        "DetachedBackward": "raw pointers are not Send in Rust: a wrapper carries the problem into the GIL-free closure",
        "problem": "a Rust problem borrows the per-sequence vectors: ConvertedProblem::problem lends it "
                   "(C++ points the spans at them inside convert_problem)",
        "DetachedCall": "raw pointers are not Send in Rust: a wrapper carries the problem into the GIL-free closure",
        "run": "raw pointers are not Send in Rust: a wrapper carries the problem into the GIL-free closure",
        **{name: "pybind11's dispatcher matches keywords slowly (a str per parameter per call): C++ matches "
                 "attention_forward's by hand, in PyO3's words; Rust's #[pyfunction] does it"
           for name in ("AttentionArgs", "attention_arguments", "name_list", "ATTENTION_NAMES", "ATTENTION_ARGS",
                        "ATTENTION_POSITIONAL")},
    },
}

# Differences that no language forces and that are not aligned yet, each with why it stays (a
# rename cannot align it: one port is laid out or split differently). A stale entry fails.
NOT_YET_ALIGNED: dict[str, set[str]] = {
    # C++ one class template VecAvx512Unit<kUnit> serves the float32, the bf16-dot and the AMX
    # units' vector types (VecAvx512, VecAvx512Bf16 and VecAvx512Amx are aliases) and wraps _mm512_mask_shuffle_f32x4 as
    # shuffle_groups; Rust has the one type and calls _mm512_shuffle_f32x4 inline.
    "cpp/src/simd_avx512.hpp": {"VecAvx512Bf16", "VecAvx512Amx", "VecAvx512Unit", "shuffle_groups"},
    # C++ names the 4-lane halves of the 8-lane operations; Rust writes them inline.
    "cpp/src/simd_neon.hpp": {"load4", "reduce4_group", "store4"},
    # C++ names the broadcast of one bf16 pair; Rust calls _mm512_set1_epi32 inline.
    "cpp/src/flash_avx512bf16.cpp": {"broadcast_pair"},
    # Rust carves the per-row arrays out of one allocation each (rows: max, sum, rescale;
    # partials: max, sum, out); C++ allocates three. attention_forward_with (a given instruction
    # set) is Rust's test entry; C++ tests switch with set_isa.
    "cpp/include/twinattn/flash_attention.hpp": {
        "CallerBuffers.partial_max", "CallerBuffers.partial_out", "CallerBuffers.partial_sum",
        "CallerBuffers.partials", "ScratchBuffers.rescale", "ScratchBuffers.row_max",
        "ScratchBuffers.row_sum", "ScratchBuffers.rows", "attention_forward_with"},
    # Rust builds each instruction set's table as a compile-time const (table); C++ fills
    # Dispatch::table once at run time (kernels_for).
    "cpp/src/dispatch.hpp": {"Dispatch.table", "table"},
    # C++ spells an expected shape as Dim values (dim_string), an extent as a struct with an empty
    # flag and counts elements (element_count); Rust formats the expected shape in a closure,
    # uses Option<(lowest, end)> and tests shape.iter().any(n <= 0).
    "cpp/include/twinattn/problem.hpp": {
        "Dim", "Dim.name", "Dim.value", "dim_string", "Extent", "Extent.empty", "Extent.end",
        "Extent.lowest", "element_count"},
    # C++ fills a view's shape and strides with one template (fill_shape_strides); Rust returns
    # each array (shape_of, strides_of) and builds the three ParamView types from param_parts in
    # its param_view! macro. C++ passes the kernel as a template argument; Rust an enum (Kernel).
    "cpp/python/bindings.cpp": {
        "fill_shape_strides", "shape_of", "strides_of", "param_parts", "Kernel.Fast",
        "Kernel.Reference"},
}

# ---- extraction ---------------------------------------------------------------------------------

CPP_KEYWORDS = {
    "if", "for", "while", "switch", "return", "sizeof", "static_assert", "decltype", "alignof",
    "catch", "throw", "new", "delete", "operator", "defined", "__attribute__", "alignas",
    "noexcept", "static_cast", "reinterpret_cast", "const_cast", "PYBIND11_MODULE",
}


# One pass, left to right, so that a // inside a string or a quote inside a comment is no trouble.
_TOKENS = re.compile(
    r'(?P<comment>//[^\n]*|/\*.*?\*/)'
    r'|(?P<raw>\bR"\((?:.*?)\)"|\br#*"(?:.*?)"#*)'
    r'|(?P<string>b?"(?:\\.|[^"\\])*")'
    r"|(?P<char>b?'(?:\\.|[^'\\\n])')",
    re.S,
)


def strip_comments_and_strings(text: str) -> str:
    """Comments out, string and character literals emptied (both languages)."""
    def replace(match: re.Match[str]) -> str:
        kind = match.lastgroup
        return " " if kind == "comment" else "' '" if kind == "char" else '""'
    return _TOKENS.sub(replace, text)


def strip_cpp(text: str) -> str:
    text = strip_comments_and_strings(text)
    text = re.sub(r"^[ \t]*#[^\n]*(?:\\\n[^\n]*)*", "", text, flags=re.M)
    text = re.sub(r"__attribute__\s*\(\(.*?\)\)", " ", text)
    return text.replace("__extension__", " ")


def strip_rust(text: str) -> str:
    text = strip_comments_and_strings(text)
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
    # a standard trait's methods (C++: constructors, destructors, operators) do not count
    if re.match(r"^impl(<[^>]*>)?\s+(std::)?(fmt::)?(Default|Drop|Display|Debug|Clone|From<.*?>|"
                r"error::Error)\s+for\b", h):
        return ("body", "")
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
                if m and re.match(r"k[A-Z0-9]", m.group(1)):  # a C enum used for constants
                    names.add(cpp_const_name(m.group(1)))
                elif m:
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
        if kind in ("struct", "enum"):  # fields (name: Type) or variants, as Type.name
            member = r"\s*(?:pub(?:\([^)]*\))?\s+)?(\w+)\s*:" if kind == "struct" else r"\s*(\w+)"
            names.update(f"{owner}.{m.group(1)}" for m in map(re.compile(member).match, split_top(h)) if m)
            continue
        if kind not in ("ns", "class"):
            continue
        for statement in [h]:
            m = RUST_ITEM.match(statement)
            if m and m.group(2) != "_":  # const _: () = assert!(..): C++'s static_assert
                names.add(m.group(2))
            # the x86 vector types' one-intrinsic operations (simd_x86.rs): name: intrinsic pairs
            m = re.search(r"one_intrinsic_ops!\s*\((.*)\)$", statement, re.S)
            if m:
                names.update(re.findall(r"(\w+)\s*:", m.group(1)))
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


def check(list_all: bool = False, pairs=None) -> list[str]:
    problems: list[str] = []
    for cpp_files, rust_files in pairs if pairs is not None else PAIRS:
        cpp = names_of(cpp_files, cpp_names)
        rust = names_of(rust_files, rust_names)
        forced = {**FORCED.get(cpp_files[0], {}),
                  **dict.fromkeys(NOT_YET_ALIGNED.get(cpp_files[0], ()), "not yet aligned")}
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
                problems.append(f"{label}: {name} is listed as one-sided, but is not (any more)")
    return problems


def main() -> int:
    problems = check(list_all="--list" in sys.argv)
    for problem in problems:
        print(problem)
    print(f"{len(problems)} difference(s) between the twins")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
