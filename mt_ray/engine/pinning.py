"""Page-locking existing host buffers for full-speed, asynchronous copies to and from the GPU.

`cudaHostRegister` on a plain allocation is ~13x cheaper than allocating with
`pin_memory=True`, and unlike the caching host allocator it does not round the size up to
a power of two (which costs gigabytes on large buffers).
"""

from __future__ import annotations

import torch


def register_pinned(buf: torch.Tensor) -> torch.Tensor:
    """Page-lock `buf` in place (it must stay alive until `unregister_pinned`)."""
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.numel() * buf.element_size() / 2**30:.1f} GiB failed: {err}")
    return buf


def unregister_pinned(buf: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host buffer, page-locked when `pin` (i.e. when a GPU will read it)."""
    buf = torch.empty(numel, dtype=dtype)
    return register_pinned(buf) if pin else buf
