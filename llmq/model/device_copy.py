"""Host lists to device tensors without waiting for the device."""
from __future__ import annotations

import torch


def to_device(values: list, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """torch.tensor(values) on `device`. non_blocking, because a plain copy to a GPU first waits for
    the device to finish everything it was given, which would stall the host once per step input."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
