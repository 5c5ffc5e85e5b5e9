"""Host lists to device tensors without waiting for the device."""
from __future__ import annotations

import numpy as np
import torch

# Integer lists become host tensors through numpy, several times faster than torch.tensor builds them (a
# step's block tables, slots and positions pay that every step). Floats (a few sampling parameters) take
# torch.tensor, whose rounding and overflow to inf they keep, without numpy's warnings.
_NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32, torch.bool: np.bool_}


def to_device(values: list, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`. non_blocking, because a plain copy to a GPU first
    waits for the device to finish everything it was given, which would stall the host once per step input."""
    numpy_dtype = _NUMPY_DTYPES.get(dtype)
    host = (torch.from_numpy(np.array(values, dtype=numpy_dtype)) if numpy_dtype is not None
            else torch.tensor(values, dtype=dtype))
    return host.to(device, non_blocking=True)
