"""Host weights into the rollout copy: page-locked DMA to the device, the dtype cast there.

`load_state_dict` would convert an fp32 master into the copy's bf16 on the CPU, into a pageable temporary, before a
blocking copy: seconds at 7B on a rollout replica's one thread. Here a source already in the copy's dtype is one
asynchronous DMA straight into its parameter (a memcpy into one kept in host memory); any other goes through two
device staging slots
(`staging_buf[slot]`, `SLOT_BYTES` each) in pieces, the DMA of one piece overlapping the cast of the last on the
compute stream. A parameter kept in host memory (the streamed copy's decoder layers) gets the cast piece back by
DMA from a device cast slot. The sources must stay unchanged until `load` returns (it waits for every copy), and
should be page-locked (the arena is, in a rollout replica; the engine's host weights are) or the DMAs are
synchronous. On the CPU the slots are host tensors and every copy synchronous: the path is the same.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mt_ray.engine.sizing import ROLLOUT_SLOT_BYTES

# a piece: long enough that a DMA's fixed cost is nothing (2.6 ms at 25 GB/s), two a small cost (the device model's)
SLOT_BYTES = ROLLOUT_SLOT_BYTES


class PinnedUpload:
    """Copies (host source, destination) pairs, casting to the destination's dtype on `device`."""

    def __init__(self, device: torch.device, slot_bytes: int = SLOT_BYTES):
        self.device = device
        self.cuda = device.type == "cuda"
        self.slot_bytes = slot_bytes
        self.staging_buf: list[torch.Tensor] | None = None  # made the first time a weight needs a cast
        self.cast_buf: list[torch.Tensor] | None = None  # made the first time a cast one goes back to host memory
        self.pieces = 0
        if self.cuda:
            self.h2d_stream = torch.cuda.Stream(device)
            self.staged = [torch.cuda.Event() for _ in range(2)]  # the slot's DMA has landed
            self.slot_free = [torch.cuda.Event() for _ in range(2)]  # the cast that read the slot has run

    def load(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each `(dst, src)`: `src` (host, contiguous) into `dst`, cast to its dtype; returns once all landed."""
        if self.cuda:  # the copy's last kernels (a generate, a streamed layer's prefetch) are done with its weights
            self.h2d_stream.wait_stream(torch.cuda.current_stream(self.device))
        for dst, src in pairs:
            if dst.shape != src.shape:
                raise ValueError(f"a weight of shape {tuple(src.shape)} cannot load into {tuple(dst.shape)}")
            dst_N, src_N = dst.view(-1), src.reshape(-1)
            if dst.dtype != src.dtype:
                self._staged(dst_N, src_N)
            elif dst.is_cuda:
                with torch.cuda.stream(self.h2d_stream):
                    dst_N.copy_(src_N, non_blocking=True)  # already the copy's dtype: one DMA, nothing to cast
            else:
                dst_N.copy_(src_N)  # host to host in the same dtype: a memcpy, nothing to cast
        if self.cuda:  # the caller may change the sources, and times the copy landed
            self.h2d_stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()

    def _staged(self, dst_N: torch.Tensor, src_N: torch.Tensor) -> None:
        """`src_N` to the device in pieces of a staging slot, each cast into `dst_N` there."""
        per = self.slot_bytes // max(src_N.element_size(), dst_N.element_size())  # a piece fits either slot
        for lo in range(0, src_N.numel(), per):
            hi = min(lo + per, src_N.numel())
            slot = self.pieces % 2
            self.pieces += 1
            stage = self._slot("staging_buf", slot, src_N.dtype, hi - lo)
            if self.cuda:
                self.h2d_stream.wait_event(self.slot_free[slot])  # the slot's last cast has read it
                with torch.cuda.stream(self.h2d_stream):
                    stage.copy_(src_N[lo:hi], non_blocking=True)
                self.staged[slot].record(self.h2d_stream)
                torch.cuda.current_stream(self.device).wait_event(self.staged[slot])  # the piece has landed
            else:
                stage.copy_(src_N[lo:hi])
            if dst_N.is_cuda or not self.cuda:
                dst_N[lo:hi].copy_(stage)  # the cast, on the device
            else:
                cast = self._slot("cast_buf", slot, dst_N.dtype, hi - lo)
                cast.copy_(stage)
                dst_N[lo:hi].copy_(cast, non_blocking=self.cuda)  # back to the host copy, ordered on this stream
            if self.cuda:
                self.slot_free[slot].record(torch.cuda.current_stream(self.device))

    def _slot(self, name: str, slot: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """`numel` elements of `dtype` at the start of slot `slot` of `name`'s two (made on first use)."""
        if getattr(self, name) is None:
            setattr(self, name, [torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)])
        return getattr(self, name)[slot].view(dtype)[:numel]
