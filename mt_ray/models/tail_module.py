"""The body's code after its layers as a module of the body's children it uses (`stream_tail.TailCode`), and the
check that it computes each token on its own: the head runs it on the selected tokens only, in chunks."""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.func import functional_call

from mt_ray.errors import ModelNotSupportedError
from mt_ray.models.discovery import ModelSpec, shallow_copy
from mt_ray.models.stream_tail import Stream

_PROBE_TOKENS = 5


class TailModule(nn.Module):
    """Runs the tail's code on [N, ...] tokens of the (token-major) stream, with `self` the body (a copy) whose
    children are the modules registered here, so that weights bind to them by `<child>.` names."""

    def __init__(self, spec: ModelSpec, stream: Stream):
        super().__init__()
        for attr in spec.tail_attrs:
            self.add_module(attr, getattr(spec.base, attr))
        self.stream = stream
        namespace = vars(inspect.getmodule(inspect.unwrap(type(spec.base).forward)))
        self.__dict__["_code"] = spec.tail_code.function(namespace)
        self.__dict__["_body"] = shallow_copy(spec.base)

    def forward(self, h_ND: torch.Tensor) -> torch.Tensor:
        """[N, ...] stream -> [1, N, D] hidden state, as the body hands it to the LM head."""
        return self._code(self._body, self.stream.to_layers(h_ND[None]), **self.stream.tail_values)


def check_per_token(spec: ModelSpec, stream: Stream, device: torch.device) -> None:
    """Refuse a tail whose tokens see each other: with random weights, each token of a random stream must come out
    the same run alone as run with the others."""
    tail = TailModule(spec, stream)
    g = torch.Generator().manual_seed(0)
    weights = {p.local_name: torch.randn(p.shape, generator=g).to(device) * 0.5 for p in spec.unit("head").params
               if p.local_name.split(".")[0] in spec.tail_attrs}
    x = torch.randn(_PROBE_TOKENS, *stream.token_shape, generator=g).to(device)
    with torch.no_grad():
        together = functional_call(tail, weights, (x,), tie_weights=False)
        alone = torch.cat([functional_call(tail, weights, (x[i:i + 1],), tie_weights=False)
                           for i in range(_PROBE_TOKENS)], dim=1)
    if not torch.allclose(together, alone, rtol=1e-4, atol=1e-5):
        raise ModelNotSupportedError(
            f"'{spec.config.model_type}': the code its body runs after its layers mixes tokens, which mt-ray's head, "
            "run on the selected tokens alone, would not; this family cannot be trained yet")

