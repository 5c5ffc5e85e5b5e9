"""Host lists to device tensors without waiting for the device."""
from __future__ import annotations

import numpy as np
import torch

# The dtypes numpy has: a list becomes a host tensor through numpy in these, several times faster than
# torch.tensor builds it from the list (a step's block tables, slots and positions pay that every step).
_NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64,
                 torch.bool: np.bool_}


def to_device(values: list, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`. non_blocking, because a plain copy to a GPU first
    waits for the device to finish everything it was given, which would stall the host once per step input."""
    numpy_dtype = _NUMPY_DTYPES.get(dtype)
    host = (torch.from_numpy(np.array(values, dtype=numpy_dtype)) if numpy_dtype is not None
            else torch.tensor(values, dtype=dtype))  # bfloat16, float16: numpy has neither
    return host.to(device, non_blocking=True)
