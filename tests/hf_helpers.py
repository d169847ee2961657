"""What the torch and Hugging Face test modules share (import it only after torch imported).

Tolerance: twinattn's logits may differ from the reference by at most FACTOR times the gap that
transformers' own implementations (eager and sdpa) show on the same inputs in the same dtype,
plus a floor of a few units of roundoff of the largest value (FLOOR_ULPS float32 ulps;
BF16_FLOOR_ULPS bfloat16 ulps).
"""

from __future__ import annotations

import inspect
from typing import Any, Iterator

import numpy as np
import pytest
import torch

import twinattn
from helpers import UNIT_ROUNDOFF
from twinattn.core._threads import configured_num_threads

FACTOR = 4.0
FLOOR_ULPS = 16.0
BF16_ROUNDOFF = 2.0**-8  # 8 significant bits: rounding to nearest moves a value by at most 2^-8 of it
BF16_FLOOR_ULPS = 2.0


def tolerance(gap: float, want: Any, roundoff: float = UNIT_ROUNDOFF, floor_ulps: float = FLOOR_ULPS) -> float:
    return FACTOR * gap + floor_ulps * roundoff * float(want.abs().max())


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # two threads on a machine shared with other jobs make torch's OpenMP pool spin; the
    # comparisons do not depend on the thread count
    # (configured_num_threads: None when unset, so the default comes back after the module rather
    # than the count it resolved to, which would pin it for the modules after this one)
    torch_threads, ours = torch.get_num_threads(), configured_num_threads()
    torch.set_num_threads(1)
    twinattn.set_num_threads(1)
    yield
    torch.set_num_threads(torch_threads)
    twinattn.set_num_threads(ours)


def cache_kw(model: Any) -> str:
    # transformers 5.x renamed past_key_values to cache (the old name warns)
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def forward_logits(model: Any, impl: str, ids: Any, mask: Any, cache: Any) -> Any:
    """One forward with attention implementation `impl`, positions from the (left-)padding mask."""
    model.set_attn_implementation(impl)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_kw(model): cache}).logits
