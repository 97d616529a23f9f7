"""A decoder layer's token-wise parts (its norms and dense MLP) run over the sequence in chunks.

At long context a layer's activations are mostly its MLP's: a SwiGLU MLP keeps gate, up,
act(gate) and their product, four intermediate-size vectors a token (7B: 151 KB a token, against
40 KB for attention with a flash kernel), and transformers' norms keep fp32 copies of their
input and output. These parts treat every token alone, so running them over chunks of tokens
computes exactly what they compute at once. With `chunk_tokens`, each such child of every
decoder layer (class name ending in 'MLP' with no experts inside, or in 'Norm') runs chunk by
chunk: without a graph simply in chunks, and under autograd as one `_TokenChunks` node that
keeps only the input and, in backward, recomputes one chunk at a time and takes its gradient.
The layer's graph then holds one input a token for each wrapped part, the MLP's intermediates
exist for one chunk at a time, and the cost is one more forward of these parts in backward.

Tensor shape key: N tokens (batch and sequence flattened), D the part's input width.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from mt_ray.models.discovery import ModelSpec


def apply_token_chunks(spec: ModelSpec, chunk_tokens: int | None) -> list[str]:
    """(Re)wrap the token-wise children of every layer kind to run in chunks of `chunk_tokens`
    (None: unwrap); returns the wrapped children's names, as 'kind.child'."""
    wrapped = []
    for kind, layer in spec.layer_kinds.items():
        for name, child in layer.named_children():
            current = vars(child).get("forward")
            if isinstance(current, ChunkedForward):  # a previous engine's wrapping: undo it first
                if current.inner_was_bound_here:
                    child.forward = current.inner
                else:
                    del child.forward
            if chunk_tokens and token_wise(child):
                child.forward = ChunkedForward(child, chunk_tokens)
                wrapped.append(f"{kind}.{name}")
    return wrapped


def token_wise(module: nn.Module) -> bool:
    """Norms, and MLPs with no experts (a MoE block routes tokens and records router logits)."""
    cls = type(module).__name__
    if cls.endswith("Norm"):
        return True
    return cls.endswith("MLP") and not any("expert" in n for n, _ in module.named_modules())


class ChunkedForward:
    """Installed as a module's `forward`: runs the module's own forward (`inner`) chunk by chunk."""

    def __init__(self, module: nn.Module, chunk_tokens: int):
        self.module = module
        self.inner_was_bound_here = "forward" in vars(module)  # Liger binds its kernels' forward on the instance
        self.inner = module.forward
        self.chunk = chunk_tokens
        self.names = [n for n, _ in module.named_parameters()]
        self.passthrough = False  # set while `run` calls the module for one chunk

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.passthrough or args or kwargs or x.shape[:-1].numel() <= self.chunk:
            return self.inner(x, *args, **kwargs)
        # The weights as bound right now (by the engine's functional_call), so backward can bind them again.
        weights = [functools.reduce(getattr, n.split("."), self.module) for n in self.names]
        if not torch.is_grad_enabled():
            return self.forward_chunks(x, weights)
        return _TokenChunks.apply(self, x, *weights)

    def run(self, x_ND: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
        """The module's own forward on one chunk, with `weights` bound to it."""
        self.passthrough = True
        try:
            return functional_call(self.module, dict(zip(self.names, weights, strict=True)), (x_ND,),
                                   tie_weights=False)
        finally:
            self.passthrough = False

    def forward_chunks(self, x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
        x_ND = x.reshape(-1, x.shape[-1])
        out_ND = None
        for s in range(0, x_ND.shape[0], self.chunk):
            y = self.run(x_ND[s : s + self.chunk], weights)
            if out_ND is None:  # filled in place: concatenating would hold every chunk twice
                out_ND = y.new_empty(x_ND.shape[0], y.shape[-1])
            out_ND[s : s + self.chunk] = y
        return out_ND.view(*x.shape[:-1], -1)

    def backward_chunks(self, x: torch.Tensor, weights: Sequence[torch.Tensor], g: torch.Tensor,
                        needs: Sequence[bool]) -> list[torch.Tensor | None]:
        """Gradients for (x, *weights): each chunk recomputed and differentiated alone; weight gradients
        summed in fp32 over the chunks, as one matmul over all tokens accumulates them."""
        x_ND, g_NE = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        gx_ND = torch.empty_like(x_ND) if needs[0] else None
        sums = [torch.zeros_like(w, dtype=torch.float32) if need else None for w, need in zip(weights, needs[1:], strict=True)]
        for s in range(0, x_ND.shape[0], self.chunk):
            with torch.enable_grad():
                xc = x_ND[s : s + self.chunk].detach().requires_grad_(needs[0])
                ws = [w.detach().requires_grad_(need) for w, need in zip(weights, needs[1:], strict=True)]
                wanted = [t for t, need in zip([xc, *ws], needs, strict=True) if need]
                grads = iter(torch.autograd.grad(self.run(xc, ws), wanted, g_NE[s : s + self.chunk]))
            if needs[0]:
                gx_ND[s : s + self.chunk] = next(grads)
            for acc in sums:
                if acc is not None:
                    acc += next(grads)
        grads_w = [None if acc is None else acc.to(w.dtype) for acc, w in zip(sums, weights, strict=True)]
        return [None if gx_ND is None else gx_ND.view_as(x), *grads_w]


class _TokenChunks(torch.autograd.Function):
    """One autograd node for a chunked part: keeps its input (and weights) only."""

    @staticmethod
    def forward(ctx, chunked: ChunkedForward, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.chunked = chunked
        ctx.save_for_backward(x, *weights)
        return chunked.forward_chunks(x, weights)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, *weights = ctx.saved_tensors
        return None, *ctx.chunked.backward_chunks(x, weights, g, ctx.needs_input_grad[1:])
