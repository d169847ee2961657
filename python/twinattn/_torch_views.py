"""NumPy views of torch CPU tensors and tensors over NumPy arrays, without copies: what
twinattn.torch and twinattn.hf read tensors through (needs torch)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import torch
import torch.utils.dlpack

# NumPy has no bfloat16: a bfloat16 tensor is viewed as int16 (the same bytes) and that as
# ml_dtypes.bfloat16, the NumPy dtype twinattn's bfloat16 API takes. Measured per tensor on the tiny
# case: Tensor.numpy() 0.6 us; bfloat16 through the int16 view 1.1-1.3 us (the view alone 0.46 us);
# np.from_dlpack 2.0 us (Tensor.__dlpack__ alone costs that, and NumPy has no bfloat16); an
# __array_interface__ object 1.5 us. torch.utils.dlpack.to_dlpack costs 0.2 us, and the native
# ports read its capsule in place of an array (docs/native_api.md): twinattn.torch's plain call
# hands them those, which skips the requires-grad check (the caller makes it).
BFLOAT16 = torch.bfloat16
INT16 = torch.int16
NP_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
NP_INT16 = np.dtype(np.int16)
to_numpy = torch.Tensor.numpy
to_dlpack = torch.utils.dlpack.to_dlpack
view = torch.Tensor.view
from_numpy = torch.from_numpy
# the NumPy dtype each of those is viewed as (twinattn.hf's cache stores in it)
NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.float16), torch.bfloat16: NP_BFLOAT16}


def array(name: str, t: Any) -> np.ndarray:
    """A NumPy view of a CPU tensor that takes part in no autograd graph (bfloat16 as
    ml_dtypes.bfloat16); no copy, whatever the strides."""
    try:
        if t.dtype is BFLOAT16:
            return to_numpy(view(t, INT16)).view(NP_BFLOAT16)  # type: ignore[no-any-return]
        # Tensor.numpy refuses what it cannot view (another device, requires grad, a sparse
        # layout, a non-tensor): checked_array then says which, in twinattn's words
        return to_numpy(t)  # type: ignore[no-any-return]
    except (AttributeError, TypeError, RuntimeError):
        return checked_array(name, t)


def checked_array(name: str, t: Any) -> np.ndarray:
    """array's slow path: a clear error for what cannot be read in place, or the view of a tensor
    that requires grad where no graph is recorded (torch.no_grad)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(
            f"{name}: twinattn runs on the CPU; expected a CPU tensor, got one on {t.device} "
            f"(move it with {name}.cpu(), or use torch's own attention on that device)"
        )
    if t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            f"{name}: requires grad, but this call computes the forward pass only (no backward; "
            "twinattn.torch.attention is the differentiable call); call it under torch.no_grad() or "
            "torch.inference_mode(), or pass a detached tensor"
        )
    if t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense strided tensor, got layout {t.layout}")
    t = t.detach()
    if t.dtype is BFLOAT16:
        return to_numpy(view(t, INT16)).view(NP_BFLOAT16)  # type: ignore[no-any-return]
    return to_numpy(t)  # type: ignore[no-any-return]


def tensor(a: np.ndarray) -> torch.Tensor:
    """The tensor sharing a NumPy array's memory (ml_dtypes.bfloat16 as torch.bfloat16)."""
    if a.dtype is NP_BFLOAT16:
        return view(from_numpy(a.view(NP_INT16)), BFLOAT16)
    return from_numpy(a)
