"""What the Hugging Face test modules share (import it only after torch and twinattn.hf imported).

Tolerance: twinattn's logits may differ from the reference by at most FACTOR times the gap that
transformers' own float32 implementations show on the same inputs, plus FLOOR_ULPS float32 ulps
of the largest value.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterator

import pytest
import torch

import twinattn
from helpers import UNIT_ROUNDOFF

FACTOR = 4.0
FLOOR_ULPS = 16.0


def tolerance(gap: float, want: Any) -> float:
    return FACTOR * gap + FLOOR_ULPS * UNIT_ROUNDOFF * float(want.abs().max())


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # two threads on a machine shared with other jobs make torch's OpenMP pool spin; the
    # comparisons do not depend on the thread count
    torch_threads, ours = torch.get_num_threads(), twinattn.get_num_threads()
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
