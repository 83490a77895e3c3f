"""Offloading checkpointed hidden states to host memory (zeroengine.activation_checkpointing.offload_hidden,
DeepSpeed's get_checkpoint_hidden_states_offloading_ctx_manager) on a small Llama with every layer checkpointed.

Without an accelerator the hidden states are in host memory already: the context says so and changes nothing.
With ``offload_host_tensors`` it treats them as device tensors (copying them to separate host buffers), which
exercises what it does on a GPU but the stream: which tensors are marked and moved, the last ones kept, the
values brought back for backward (gradients bit-identical to a run without it), the buffers reused."""
from __future__ import annotations

import logging

import pytest
import torch

from zeroengine.activation_checkpointing.offload_hidden import (
    CheckpointHiddenStatesOffload,
    get_checkpoint_hidden_states_offloading_ctx_manager,
)

transformers = pytest.importorskip("transformers")
LAYERS = 4


def model(use_reentrant: bool):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(config)
    m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    m.train()
    return m


def grads(m, context=None):
    ids = torch.randint(64, (2, 24), generator=torch.Generator().manual_seed(1))
    m.zero_grad()
    if context is None:
        m(input_ids=ids, labels=ids).loss.backward()
    else:
        with context:
            m(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("keep_last", [0, 1, 2])
def test_offloaded_hidden_states_come_back_exactly(use_reentrant, keep_last):
    m = model(use_reentrant)
    plain = grads(m)
    context = CheckpointHiddenStatesOffload(keep_last_count=keep_last, min_offload_bytes=0, offload_host_tensors=True)
    offloaded = grads(m, context)
    assert context.stats.offloaded == LAYERS - keep_last and context.stats.restored == LAYERS - keep_last
    assert context.stats.kept == keep_last
    assert context.stats.offloaded_bytes == (LAYERS - keep_last) * 2 * 24 * 32 * 4
    for name in plain:
        assert torch.equal(plain[name], offloaded[name]), name
    # the same context again: its host buffers are reused, not allocated anew
    pool_before = sum(len(v) for v in context._pool.values())
    grads(m, context)
    assert context.stats.offloaded == 2 * (LAYERS - keep_last)
    assert sum(len(v) for v in context._pool.values()) == pool_before


def test_small_tensors_and_layers_without_checkpointing_are_left_alone():
    m = model(use_reentrant=False)
    context = CheckpointHiddenStatesOffload(min_offload_bytes=10**9, offload_host_tensors=True)
    grads(m, context)
    assert context.stats.offloaded == 0 and context.stats.kept == 0
    m.activation_checkpointing_disable()
    context = CheckpointHiddenStatesOffload(min_offload_bytes=0, offload_host_tensors=True, keep_last_count=0)
    grads(m, context)
    assert context.stats.offloaded == 0  # nothing is checkpointed: nothing is marked


def test_without_an_accelerator_it_says_so_and_changes_nothing(caplog):
    if torch.cuda.is_available():
        pytest.skip("has an accelerator")
    m = model(use_reentrant=False)
    plain = grads(m)
    with caplog.at_level(logging.INFO, logger="zeroengine"):
        context = get_checkpoint_hidden_states_offloading_ctx_manager(min_offload_bytes=0)
        again = grads(m, context)
    assert "nothing to offload" in caplog.text or "changes nothing" in caplog.text
    assert context.stats.on_host_already == LAYERS and context.stats.offloaded == 0
    assert all(torch.equal(plain[n], again[n]) for n in plain)


def test_the_context_is_not_reentrant_and_leaves_the_layers_as_they_were():
    from transformers.modeling_layers import GradientCheckpointingLayer

    context = CheckpointHiddenStatesOffload()
    with context:
        assert "__call__" in GradientCheckpointingLayer.__dict__
        with pytest.raises(RuntimeError, match="not re-entrant"):
            context.__enter__()
    assert "__call__" not in GradientCheckpointingLayer.__dict__
    with pytest.raises(ValueError, match="keep_last_count"):
        CheckpointHiddenStatesOffload(keep_last_count=-1)


def test_deepspeeds_module_path_has_it():
    from zeroengine.integrations.ds_compat.runtime.activation_checkpointing import offload_activations

    assert offload_activations.get_checkpoint_hidden_states_offloading_ctx_manager is \
        get_checkpoint_hidden_states_offloading_ctx_manager
