"""The int8 KV cache's effect on a model: SmolLM2-135M-Instruct reads a 2048-token
English text twice, with attn_implementation="twinattn" both times, once with a float32
TwinattnCache and once with TwinattnCache(kv_dtype="int8"), and the next-token log-probabilities
at every position are compared.

    python -m twinattn.bench.kv_quality [--tokens 2048] [--chunk 256] [--text PATH] [--json PATH]

The text is CPython's own LICENSE.txt (the history of the software and its licenses, English
prose), which every CPython installation ships beside its standard library; --text reads another.
It is fed in chunks of --chunk tokens, each appended to the cache before its attention, exactly
as decoding appends one token: the int8 run's every attention reads the quantized keys and values
of every earlier token and its own (per-token scales do not depend on the other tokens, so chunk
size changes nothing but speed).

Printed (log-probabilities in float64 from the float32 logits; positions: every token but the last):
  log-prob diff, all vocab    max and mean over positions and vocabulary of |int8 - float32|
  log-prob diff, next token   max and mean over positions of the text's actual next token's
  greedy changed              the fraction of positions whose argmax token differs
  perplexity                  exp(-mean log-prob of the actual next token), each cache
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
from typing import Any, Optional, Sequence

import numpy as np

from .. import models
from . import e2e


def default_text_path() -> str:
    """CPython's LICENSE.txt, beside the standard library it ships with."""
    return os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")


def log_probs(model: Any, ids: Any, cache: Any, chunk: int) -> np.ndarray:
    """(T, vocab) float64 log-softmax of the logits at every position of `ids` (1, T), fed into
    `cache` `chunk` tokens at a time with attn_implementation="twinattn"."""
    import inspect

    import torch

    model.set_attn_implementation("twinattn")
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    parts = []
    with torch.inference_mode():
        for start in range(0, ids.shape[1], chunk):
            piece = ids[:, start : start + chunk]
            positions = torch.arange(start, start + piece.shape[1])[None]
            logits = model(input_ids=piece, position_ids=positions, use_cache=True, **{name: cache}).logits
            parts.append(torch.log_softmax(logits[0].double(), dim=-1).numpy())
    result: np.ndarray = np.concatenate(parts)
    return result


def compare(model: Any, ids: Any, chunk: int = 256) -> dict[str, Any]:
    """The figures of the module docstring for token ids (1, T), T >= 2."""
    from ..hf import TwinattnCache

    length = int(ids.shape[1])
    if length < 2:
        raise ValueError(f"ids: expected at least 2 tokens (a position and its next token), got {length}")
    runs = {}
    for kv_dtype in (None, "int8"):
        cache = TwinattnCache(max_cache_len=length, config=model.config, kv_dtype=kv_dtype)
        runs["int8" if kv_dtype else "float32"] = (log_probs(model, ids, cache, chunk)[:-1], cache.nbytes)
    (wide, wide_bytes), (narrow, narrow_bytes) = runs["float32"], runs["int8"]
    target = ids[0, 1:].numpy()
    rows = np.arange(length - 1)
    diff = np.abs(narrow - wide)
    next_diff = diff[rows, target]
    return {
        "model": models.MODELS["smollm2"].title,
        "tokens": length,
        "positions": length - 1,
        "chunk": chunk,
        "logprob_diff_max": float(diff.max()),
        "logprob_diff_mean": float(diff.mean()),
        "next_token_logprob_diff_max": float(next_diff.max()),
        "next_token_logprob_diff_mean": float(next_diff.mean()),
        "greedy_changed": int((narrow.argmax(-1) != wide.argmax(-1)).sum()),
        "greedy_changed_fraction": float((narrow.argmax(-1) != wide.argmax(-1)).mean()),
        "perplexity_float32": math.exp(-float(wide[rows, target].mean())),
        "perplexity_int8": math.exp(-float(narrow[rows, target].mean())),
        "cache_bytes_float32": wide_bytes,
        "cache_bytes_int8": narrow_bytes,
    }


def format_report(result: dict[str, Any]) -> str:
    r = result
    return "\n".join([
        f"{r['model']}, {r['tokens']} tokens of {r.get('text', 'the given ids')}, fed {r['chunk']} at a time; "
        f"int8 TwinattnCache against float32 TwinattnCache, {r['positions']} positions:",
        f"  log-prob diff, all vocab:   max {r['logprob_diff_max']:.4f}  mean {r['logprob_diff_mean']:.2e}",
        f"  log-prob diff, next token:  max {r['next_token_logprob_diff_max']:.4f}  "
        f"mean {r['next_token_logprob_diff_mean']:.2e}",
        f"  greedy token changed:       {r['greedy_changed']} of {r['positions']} positions "
        f"({100 * r['greedy_changed_fraction']:.2f}%)",
        f"  perplexity:                 float32 {r['perplexity_float32']:.3f}  int8 {r['perplexity_int8']:.3f}",
        f"  cache bytes:                float32 {r['cache_bytes_float32']:,}  int8 {r['cache_bytes_int8']:,} "
        f"({r['cache_bytes_int8'] / r['cache_bytes_float32']:.3f}x)",
    ])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m twinattn.bench.kv_quality",
        description="The int8 KV cache's effect on SmolLM2-135M's next-token log-probs over an English text.",
    )
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the text to read (default 2048)")
    parser.add_argument("--chunk", type=int, default=256, help="tokens appended per forward (default 256)")
    parser.add_argument("--text", metavar="PATH", help=f"the text (default: CPython's {default_text_path()})")
    parser.add_argument("--threads", type=int, help="twinattn and torch threads (default: as they are)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.chunk < 1:
        parser.error(f"--tokens: expected >= 2 and --chunk >= 1, got {args.tokens} and {args.chunk}")
    why = e2e.missing("smollm2")
    if why is not None:
        parser.error(f"the quality report {why}")
    path = args.text or default_text_path()
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        parser.error(f"--text: cannot read {path}: {exc.strerror}")
    import torch

    import twinattn

    if args.threads:
        torch.set_num_threads(args.threads)
        twinattn.set_num_threads(args.threads)
    model, tok = models.load("smollm2")
    ids = tok(text, return_tensors="pt").input_ids[:, : args.tokens]
    if ids.shape[1] < args.tokens:
        parser.error(f"--text: {path} has {ids.shape[1]} tokens, fewer than --tokens {args.tokens}")
    result = {"text": path, **compare(model, ids, args.chunk)}
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
