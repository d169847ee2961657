"""The array types of the native modules' arguments, shared by _cpp.pyi and _rust.pyi.

Every array argument may also be a DLPack capsule of a CPU tensor (CapsuleType), read in place as
the array it describes (docs/native_api.md, "DLPack capsules").

A stub with no module behind it (nothing at run time imports it): types only, which stubtest does
not compare with anything, so sharing them costs the two stubs no checking.
"""

from typing import Any

from typing_extensions import CapsuleType, TypeAlias

import numpy as np
from numpy.typing import NDArray

# float32 (B, Hq, Lq) lse, (B, Hq) ALiBi slopes (any strides: a (Hq,) vector as a stride-0 view),
# (Hq,) sinks, (B, Hkv, Lk) int8 scales
F32: TypeAlias = NDArray[np.float32] | CapsuleType
# q, k, v, out (B, H, L, D): all float32, all float16, or all ml_dtypes.bfloat16 (a NumPy user
# dtype that numpy's stubs cannot name: NDArray[Any] stands for it)
Data: TypeAlias = NDArray[np.float32] | NDArray[np.float16] | NDArray[Any] | CapsuleType
# q_offset and kv_lens: int64 (B,); cu_seqlens_q, cu_seqlens_k (B + 1,), seq_lens (B,)
I64: TypeAlias = NDArray[np.int64] | CapsuleType
# block_table: int32 (B, max_blocks)
I32: TypeAlias = NDArray[np.int32] | CapsuleType
# k and v: q's dtype, or both int8 with their float32 (B, Hkv, Lk) scales k_scale / v_scale
KV: TypeAlias = Data | NDArray[np.int8] | CapsuleType
# bool (True = may attend) or float32 additive bias, shape (B, Hq, Lq, Lk) (a broadcast view)
Mask: TypeAlias = NDArray[np.bool_] | NDArray[np.float32] | CapsuleType
