"""The streamed rollout copy: decoder layers kept in (pinned) host memory and brought to the device one at a time
as the rollout's decode loop (decode.py, eager for a streamed copy) runs each forward, the next layer's copy
overlapping the current one's compute.

Where the whole copy cannot sit on the GPU beside the training step, only the embedding, the final norm, the head
and two layer-sized buffers (`weights_buf[slot]`) stay there, with the key/value cache. Each decoder layer's
weights live in one flat host buffer (the compute dtype, page-locked on a GPU) and its parameters are views of it
between forwards; a forward pre-hook points them at the device slot its weights landed in, and starts the next
layer's copy into the other slot on `h2d_stream`, as the engine's layer loop prefetches. With every prompt x G row
in one batch, each token step streams the weights once.

Why a hook of our own and not accelerate's (`cpu_offload`, `AlignDevicesHook`): accelerate copies a module's
weights synchronously in its pre-forward, allocating fresh device tensors each time, with no prefetch, so every
layer would wait for the link. The hook here is the engine's double buffer: two fixed device slots, a copy stream,
and an event each way (`weights_ready[slot]`: the copy landed; `weights_free[slot]`: the layer that used the slot
is done with it). On the CPU the "device" slots are host tensors and the copies synchronous: the path is the same.
"""

from __future__ import annotations

import torch
from torch import nn

from mt_ray.engine.pinning import host_empty, unregister_pinned
from mt_ray.errors import ModelNotSupportedError


class LayerStreamer:
    """Streams `layers`' weights from one host buffer through two device slots as the layers run forward."""

    def __init__(self, layers: nn.ModuleList, device: torch.device, dtype: torch.dtype):
        self.layers = list(layers)
        self.device = device
        self.cuda = device.type == "cuda"
        params = [_unique_params(layer) for layer in self.layers]
        kept = sorted({str(p.dtype) for ps in params for p in ps if p.dtype != dtype})
        if kept:  # a module the model keeps in fp32 (a router, say) would be cast in the one host buffer
            raise ModelNotSupportedError(f"rollout.placement streamed: the decoder layers hold {', '.join(kept)} "
                                         f"weights beside {dtype}; use rollout.placement: resident")
        sizes = [sum(p.numel() for p in ps) for ps in params]
        self.host_flat = host_empty(sum(sizes), dtype, pin=self.cuda)  # page-locked: the copies are async DMAs
        self.spans = [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]  # each layer's part of host_flat
        self.host_views = self._move_to_host(params)
        self.weights_buf = [torch.empty(max(sizes), dtype=dtype, device=device) for _ in range(2)]
        self.slot_layer: list[int | None] = [None, None]  # the layer each slot holds or is receiving
        self.last_slot = 1
        if self.cuda:
            self.h2d_stream = torch.cuda.Stream(device)
            self.weights_ready = [torch.cuda.Event() for _ in range(2)]
            self.weights_free = [torch.cuda.Event() for _ in range(2)]
        for i, layer in enumerate(self.layers):
            _move_buffers(layer, device)
            layer.register_forward_pre_hook(lambda _m, _a, i=i: self.before_layer(i))
            layer.register_forward_hook(lambda _m, _a, _o, i=i: self.after_layer(i))

    @property
    def host_bytes(self) -> int:
        return self.host_flat.numel() * self.host_flat.element_size()

    def _move_to_host(self, params: list[list[nn.Parameter]]) -> list[list[tuple]]:
        """Each layer's parameters copied into its part of the host buffer and made views of it; per layer, each
        parameter with its host view and its offset in the layer's part."""
        views = []
        for ps, (start, size) in zip(params, self.spans, strict=True):
            layer_flat, off, layer_views = self.host_flat[start : start + size], 0, []
            for p in ps:
                view = layer_flat[off : off + p.numel()].view_as(p)
                view.copy_(p.data)
                p.data = view
                layer_views.append((p, view, off))
                off += p.numel()
            views.append(layer_views)
        return views

    def _load(self, i: int, slot: int) -> None:
        """Start layer `i`'s copy into `slot`, once the layer that used the slot is done with it."""
        if self.slot_layer[slot] == i:
            return
        start, size = self.spans[i]
        part = self.host_flat[start : start + size]
        if self.cuda:
            self.h2d_stream.wait_event(self.weights_free[slot])  # the slot's last layer has run its kernels
            with torch.cuda.stream(self.h2d_stream):
                self.weights_buf[slot][: part.numel()].copy_(part, non_blocking=True)
            self.weights_ready[slot].record(self.h2d_stream)
        else:
            self.weights_buf[slot][: part.numel()].copy_(part)
        self.slot_layer[slot] = i

    def before_layer(self, i: int) -> None:
        """Layer `i`'s parameters on the device slot its weights are in, and layer `i + 1`'s copy started."""
        slot = self.slot_layer.index(i) if i in self.slot_layer else 1 - self.last_slot
        self._load(i, slot)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.weights_ready[slot])  # its weights have landed
        buf = self.weights_buf[slot]
        for p, view, off in self.host_views[i]:
            p.data = buf[off : off + view.numel()].view_as(view)
        self.last_slot = slot
        self._load((i + 1) % len(self.layers), 1 - slot)  # the next forward's layer (layer 0 after the last)

    def after_layer(self, i: int) -> None:
        """Layer `i` done: its slot free once its kernels have run, its parameters back on the host views."""
        if self.cuda:
            self.weights_free[self.last_slot].record(torch.cuda.current_stream(self.device))
        for p, view, _ in self.host_views[i]:
            p.data = view

    def invalidate(self) -> None:
        """Forget what the slots hold, before the host copy is rewritten (a refresh)."""
        if self.cuda:
            self.h2d_stream.synchronize()  # a prefetch may still be reading the host copy the refresh overwrites
        self.slot_layer = [None, None]

    def close(self) -> None:
        """Release the page-locking (the buffer goes with the copy)."""
        if self.cuda:
            self.h2d_stream.synchronize()  # no copy may read the buffer once it is unlocked
            unregister_pinned(self.host_flat)


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    seen, out = set(), []
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """A layer's buffers (rotary tables, masks) are small: they stay on the device."""
    for mod in module.modules():
        for name, buf in mod._buffers.items():
            if buf is not None:
                mod._buffers[name] = buf.to(device)


def move_all_but(model: nn.Module, layers: nn.ModuleList, device: torch.device) -> None:
    """Every parameter and buffer of `model` outside `layers` onto `device` (tied ones once)."""
    inside = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None and id(p) not in inside:
                p.data = p.data.to(device)
        for name, buf in mod._buffers.items():
            if buf is not None and id(buf) not in inside:
                mod._buffers[name] = buf.to(device)
