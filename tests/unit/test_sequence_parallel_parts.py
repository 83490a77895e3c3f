"""The pieces of sequence parallelism that need no second process: the mesh's sequence axis, the label shift,
move_to_device, Ulysses' head-count rules and the all-to-all layout (against a simulated group)."""
from __future__ import annotations

import pytest
import torch

from zeroengine.parallel.mesh import _axis_members, describe_layout
from zeroengine.sequence_parallel import UlyssesSPAttentionHF, move_to_device, shift_labels


def test_sequence_groups_are_consecutive_ranks_and_zero_spans_data_and_sequence():
    """DeepSpeed's parallel_state_sp layout: sequence groups [0..sp-1], [sp..2sp-1]; ZeRO over data × sequence."""
    members = _axis_members(pp=1, dp=2, tp=1, sp=4)
    assert members["sequence"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert members["data"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert members["zero"] == [list(range(8))]
    with_tp = _axis_members(pp=1, dp=1, tp=2, sp=2)  # tensor fastest, then sequence
    assert with_tp["tensor"] == [[0, 1], [2, 3]] and with_tp["sequence"] == [[0, 2], [1, 3]]
    text = describe_layout(8, sp=4)
    assert "data 2 × sequence 4" in text and "sequence groups of 4: [0, 1, 2, 3], [4, 5, 6, 7]" in text
    with pytest.raises(ValueError, match="must divide the world size"):
        describe_layout(6, sp=4)


def test_labels_are_shifted_before_they_are_cut():
    labels = torch.tensor([[5, 6, 7, 8]])
    assert shift_labels(labels).tolist() == [[6, 7, 8, -100]]


def test_move_to_device_keeps_structure_and_other_values():
    batch = {"ids": torch.ones(2), "pair": (torch.zeros(1), 3), "names": ["a"]}
    moved = move_to_device(batch, "cpu")
    assert isinstance(moved["pair"], tuple) and moved["pair"][1] == 3 and moved["names"] == ["a"]
    t = torch.ones(2)
    assert move_to_device(t, "cpu", criterion_func=lambda x: True) is t  # moved in place


@pytest.mark.parametrize("heads,kv,match", [(6, 6, "6 attention heads cannot be split over 4"),
                                            (8, 3, "3 key/value heads over 4 ranks")])
def test_head_counts_that_do_not_split_are_refused(monkeypatch, heads, kv, match):
    monkeypatch.setattr("zeroengine.comm.get_world_size", lambda group=None: 4)
    with pytest.raises(ValueError, match=match):
        UlyssesSPAttentionHF(None, 1, heads, 8, kv, 2, process_group=None)


def test_fewer_key_value_heads_than_ranks_are_replicated(monkeypatch):
    monkeypatch.setattr("zeroengine.comm.get_world_size", lambda group=None: 4)
    ulysses = UlyssesSPAttentionHF(None, 1, 8, 8, 2, 2, process_group=None)
    assert (ulysses.kv_replication, ulysses.local_q_heads, ulysses.local_kv_heads) == (2, 2, 1)


def _simulated_group(function, inputs: list[torch.Tensor], monkeypatch) -> list[torch.Tensor]:
    """``function(x, group, world)`` on every rank of a simulated group, its all-to-all done by hand: a first pass
    records what each rank sends (slot i to rank i), a second hands each rank what it receives (slot j from j)."""
    from zeroengine.sequence_parallel import all_to_all

    world, sent = len(inputs), []
    monkeypatch.setattr(all_to_all, "_exchange", lambda x, group: sent.append(x.clone()) or torch.zeros_like(x))
    for x in inputs:
        function(x, None, world)
    received = [torch.stack([sent[j][r] for j in range(world)]) for r in range(world)]
    outputs = []
    for r, x in enumerate(inputs):
        monkeypatch.setattr(all_to_all, "_exchange", lambda _x, group, r=r: received[r])
        outputs.append(function(x, None, world))
    return outputs


def test_the_all_to_all_gives_each_rank_the_whole_sequence_of_its_heads_and_back(monkeypatch):
    from zeroengine.sequence_parallel import heads_to_sequence, sequence_to_heads

    world = 2
    full = torch.arange(2 * 4 * 6 * 3, dtype=torch.float32).reshape(2, 4, 6, 3)  # [batch, heads, seq, dim]
    pieces = list(full.chunk(world, dim=2))  # rank r holds piece r of the sequence, every head
    by_heads = _simulated_group(sequence_to_heads, pieces, monkeypatch)
    for r in range(world):
        torch.testing.assert_close(by_heads[r], full[:, 2 * r:2 * r + 2])  # heads 2r, 2r + 1, the whole sequence
    back = _simulated_group(heads_to_sequence, by_heads, monkeypatch)
    for r in range(world):
        torch.testing.assert_close(back[r], pieces[r])


def test_in_eval_with_disable_in_eval_the_models_attention_runs_with_its_mask_and_training_so_warns_once(caplog):
    calls = []

    def core(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append(attention_mask)
        return query, None

    ulysses = UlyssesSPAttentionHF(core, 1, 4, 8, 4, 2, process_group=None, seq_length_is_variable=True,
                                   disable_in_eval=True)
    module = torch.nn.Linear(1, 1).eval()
    q = torch.zeros(1, 4, 6, 8)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    with caplog.at_level("WARNING", logger="zeroengine.sequence_parallel.ulysses_hf"):
        with torch.no_grad():  # evaluation: no warning
            ulysses(module, q, q, q, mask)
        assert "call model.train()" not in caplog.text
        for _ in range(2):  # gradients on in eval mode: a loop that forgot model.train(), said once
            ulysses(module, q, q, q, mask)
    assert caplog.text.count("call model.train()") == 1
    assert all(m is mask for m in calls) and len(calls) == 3  # the model's own mask, on the plain path
