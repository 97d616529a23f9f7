"""Host bytes per parameter and the refusal to allocate what cannot fit."""

import gc
import weakref

import pytest
import torch

from mt_ray.engine import EngineConfig, OptimizerConfig, StreamingEngine
from mt_ray.engine.host_store import HostStore, plan_layout
from mt_ray.errors import InsufficientMemoryError
from mt_ray.models.discovery import discover
from tests.tiny_models import tiny_config


def test_bytes_per_param_with_and_without_copy():
    spec = discover(tiny_config("llama"))
    assert plan_layout(spec, torch.bfloat16).bytes_per_param == 14
    assert plan_layout(spec, None).bytes_per_param == 12


def test_views_are_contiguous_slices_of_one_buffer():
    spec = discover(tiny_config("llama"))
    store = HostStore(spec, torch.bfloat16, pin=False)
    views = store.named_views(spec.unit("layers.1"))
    first = next(iter(views.values()))
    assert first.untyped_storage().data_ptr() == store.master.untyped_storage().data_ptr()
    store.master.fill_(2.0)
    store.refresh_copy("layers.1")
    assert torch.all(store.streamed_of("layers.1") == 2.0)
    assert torch.all(store.master_of("layers.1") == 2.0)


def test_state_that_cannot_fit_is_refused_before_allocating():
    spec = discover(tiny_config("llama", hidden_size=4096, intermediate_size=16384, num_hidden_layers=64,
                                num_attention_heads=32, num_key_value_heads=8, head_dim=128))
    with pytest.raises(InsufficientMemoryError, match=r"needs .* GiB of host RAM.*stream_master"):
        StreamingEngine(spec, EngineConfig(device="cpu", host_memory_limit_gb=4), OptimizerConfig(), 1)


def test_loading_weights_keeps_no_reference_to_the_source_tensors():
    # Parameters require grad: a copy recorded by autograd would chain the master buffer to
    # every initialised module, holding 4 B/param of device memory (seen on the H100).
    spec = discover(tiny_config("llama"))
    store = HostStore(spec, torch.bfloat16, pin=False)
    unit = spec.unit("layers.0")
    sources = {p.hf_name: torch.nn.Parameter(torch.randn(p.shape)) for p in unit.params}
    alive = [weakref.ref(t) for t in sources.values()]
    store.load_named(unit, sources)
    assert torch.equal(next(iter(store.named_views(unit).values())), next(iter(sources.values())).detach())
    del sources
    gc.collect()
    assert not store.master.requires_grad and store.master.grad_fn is None
    assert all(ref() is None for ref in alive)
