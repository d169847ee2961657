"""twinattn.torch.attention_varlen / attention_paged: torch CPU tensors read in place give the
NumPy API's results bit for bit on every backend; the custom ops pass torch.library.opcheck and
torch.compile(fullgraph=True) sees one op."""

from __future__ import annotations

import numpy as np
import pytest

import twinattn
from conftest import import_optional  # noqa: E402
from packed_helpers import random_packed, to_paged

torch = import_optional("torch", "twinattn.torch needs it: pip install torch")
tt = import_optional("twinattn.torch", "the torch integration")

DTYPES = {"float32": (torch.float32, np.float32), "bfloat16": (torch.bfloat16, None), "float16": (torch.float16, np.float16)}


def _t(a: np.ndarray) -> torch.Tensor:
    from twinattn._torch_views import tensor

    return tensor(a)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_varlen_tensors_match_numpy(backend: str, dtype: str) -> None:
    import ml_dtypes

    np_dtype = DTYPES[dtype][1] or ml_dtypes.bfloat16
    packed = random_packed(np.random.default_rng(1), [2, 0, 3], [4, 2, 5], dtype=np_dtype)
    k, v, cu_k, _ = packed.packed_kv()
    want, want_lse = twinattn.attention_varlen(packed.q, k, v, packed.cu_q, cu_k, causal=True, return_lse=True, backend=backend)
    out, lse = tt.attention_varlen(_t(packed.q), _t(k), _t(v), torch.from_numpy(packed.cu_q), torch.from_numpy(cu_k.astype(np.int32)),
                                   causal=True, return_lse=True, backend=backend)
    assert out.dtype == DTYPES[dtype][0] and lse.dtype == torch.float32
    np.testing.assert_array_equal(out.float().numpy(), want.astype(np.float32))
    np.testing.assert_array_equal(lse.numpy(), want_lse)


def test_paged_tensors_read_in_place(backend: str) -> None:
    """Interleaved K/V pages (one buffer), written after the call's views are taken: out follows."""
    rng = np.random.default_rng(2)
    packed = random_packed(rng, [1, 3], [5, 7], value_dim=8)
    paged = to_paged(rng, packed, 2)
    both = torch.from_numpy(np.stack([paged.k_cache, paged.v_cache], axis=1))
    table, lens = torch.from_numpy(paged.block_table), torch.from_numpy(paged.seq_lens)
    cu = torch.from_numpy(packed.cu_q)
    want = twinattn.attention_paged(packed.q, paged.k_cache, paged.v_cache, paged.block_table, paged.seq_lens,
                                    cu_seqlens_q=packed.cu_q, backend=backend)
    out = torch.empty(4, 4, 8)
    got = tt.attention_paged(torch.from_numpy(packed.q), both[:, 0], both[:, 1], table, lens, cu_seqlens_q=cu, out=out,
                             backend=backend)
    assert got is out
    np.testing.assert_array_equal(out.numpy(), want)


def test_custom_ops_pass_opcheck() -> None:
    packed = random_packed(np.random.default_rng(3), [2, 1], [3, 4])
    k, v, cu_k, _ = packed.packed_kv()
    options = (True, None, "numpy", None, -1, -1, 0.0, None, None, None, None)
    torch.library.opcheck(torch.ops.twinattn.attention_varlen.default,
                          (_t(packed.q), _t(k), _t(v), _t(packed.cu_q), _t(cu_k), *options))
    paged = to_paged(np.random.default_rng(3), packed, 2)
    torch.library.opcheck(torch.ops.twinattn.attention_paged.default,
                          (_t(packed.q), _t(paged.k_cache), _t(paged.v_cache), _t(paged.block_table), _t(paged.seq_lens),
                           _t(packed.cu_q), *options))


def test_compile_fullgraph_sees_one_op_each(backend: str) -> None:
    seen: list[object] = []

    def record(gm, example_inputs):  # a torch.compile backend that keeps the traced graph
        seen.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    rng = np.random.default_rng(4)
    packed = random_packed(rng, [1, 2], [3, 5])
    k, v, cu_k, _ = packed.packed_kv()
    paged = to_paged(rng, packed, 2)

    def block(q, k, v, cu_q, cu_k, k_cache, v_cache, table, lens):
        a = tt.attention_varlen(q * 2.0, k, v, cu_q, cu_k, causal=True, window_size=(2, 0), backend=backend)
        b = tt.attention_paged(q, k_cache, v_cache, table, lens, cu_seqlens_q=cu_q, softcap=0.9, backend=backend)
        return a + b

    arguments = [_t(a) for a in (packed.q, k, v, packed.cu_q, cu_k, paged.k_cache, paged.v_cache, paged.block_table, paged.seq_lens)]
    compiled = torch.compile(block, backend=record, fullgraph=True)
    got = compiled(*arguments)
    torch.testing.assert_close(got, block(*arguments), rtol=0, atol=0)
    assert sum(1 for t in seen if "twinattn" in str(t)) == 2, seen


@pytest.mark.parametrize("call", ["varlen", "paged"])
def test_an_input_that_requires_grad_is_refused_by_name(call: str) -> None:
    """These calls have no backward: under grad mode an input that requires grad raises a clear
    error naming it (not the eager path's internal signal); under torch.no_grad() the call runs."""
    rng = np.random.default_rng(5)
    packed = random_packed(rng, [2, 3], [4, 5])
    k, v, cu_k, _ = packed.packed_kv()
    paged = to_paged(rng, packed, 2)
    q = torch.from_numpy(packed.q)
    if call == "varlen":
        keys, values = torch.from_numpy(k).requires_grad_(), torch.from_numpy(v)
        run = lambda: tt.attention_varlen(q, keys, values, torch.from_numpy(packed.cu_q),  # noqa: E731
                                          torch.from_numpy(cu_k.astype(np.int32)), causal=True)
        name = "k"
    else:
        keys, values = torch.from_numpy(paged.k_cache), torch.from_numpy(paged.v_cache).requires_grad_()
        run = lambda: tt.attention_paged(q, keys, values, torch.from_numpy(paged.block_table),  # noqa: E731
                                         torch.from_numpy(paged.seq_lens), cu_seqlens_q=torch.from_numpy(packed.cu_q))
        name = "v_cache"
    with pytest.raises(RuntimeError, match=rf"^{name}: requires grad, but this call computes the forward pass only"):
        run()
    with torch.no_grad():
        assert run().shape == (packed.q.shape[0], packed.q.shape[1], values.shape[-1])
