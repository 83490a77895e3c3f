"""Smoke test of benchmarks/bench_tensor_parallel.py: --quick (tp = 2, tiny GPT-2 and Llama, DeepSpeed skipped) runs
and writes JSON of the expected shape. Collective counts are exact and asserted: GPT-2's and Llama's all-reduces and
all-gather equal Megatron's formula (2 forward + 2 backward per block, the embedding's and the LM head's one each, the logits
gathered once); memory ratios follow from the split. Timings only have to be positive."""
import math

import pytest
from bench_runs import run_benchmark

pytest.importorskip("transformers")  # the benchmark's models (a test-only dependency)


def test_quick_run_counts_megatron_bytes(tmp_path):
    stdout, result = run_benchmark("bench_tensor_parallel.py", tmp_path / "tensor_parallel.json", "--quick",
                                   timeout=120)
    assert "per block" in stdout and "tp/dp per rank" in stdout
    c, b = result["comm_model"], result["bytes"]
    act, logits = c["batch"] * c["seq"] * c["hidden"] * 4, c["batch"] * c["seq"] * c["vocab"] * 4
    assert (b["act_bytes"], b["logits_bytes"]) == (act, logits)
    rows = {(r["model"], r["tp"], r["layers"]): r for r in b["rows"]}
    assert set(rows) == {(m, 2, n) for m in ("gpt2", "llama") for n in (2, 4)}
    for (model, tp, layers), r in rows.items():
        m = r["measured"]
        assert r["other_ops"] == [], r
        # the same for both models: 2L + 1 forward all-reduces of act bytes, one all-gather of the logits
        assert m["ar_fwd"] == 2 * layers + 1 and (m["ag_calls"], m["ag_bytes"]) == (1, logits), (model, layers, m)
        assert m["ar_bytes"] == (m["ar_fwd"] + m["ar_bwd"]) * act, m  # every all-reduce is one activation
        assert m["wire_bytes"] == m["ar_bytes"] * 2 * (tp - 1) / tp + logits * (tp - 1) / tp
        # exactly Megatron's formula for both: Llama's separate q/k/v (and gate/up) layers share one copy_to
        assert m == r["expected"] and r["matches"], (model, layers, m, r["expected"])
        assert m["ar_bwd"] == 2 * layers + 1 and m["ar_bytes"] == (4 * layers + 2) * act
    blocks = {p["model"]: p for p in b["per_block"]}
    gpt2, llama = blocks["gpt2"], blocks["llama"]
    assert (gpt2["ar_fwd"], gpt2["ar_bwd"], gpt2["ar_bytes"]) == (2, 2, 4 * act) and gpt2["matches"]
    assert gpt2["wire_bytes"] == 4 * 2 * act * (2 - 1) / 2 and gpt2["explanation"] == ""
    assert (gpt2["column_layers"], gpt2["row_layers"]) == (["c_attn", "c_fc"], ["c_proj", "c_proj"])
    assert (llama["ar_fwd"], llama["ar_bwd"], llama["ar_bytes"]) == (2, 2, 4 * act) and llama["matches"]

    train = result["train"]
    runs = train["runs"]
    assert set(runs) == {"ze-dp2", "ze-tp2"}
    for r in runs.values():
        assert r["step_s"] > 0 and len(r["step_s_runs"]) == train["model"]["steps"] == 2
        assert all(math.isfinite(x) for x in r["losses"])
    # same global batch, weights and optimizer: dp=2 and tp=2 follow the same losses (only sums reordered)
    assert set(train["compare"]) == {"ze-tp2/ze-dp2"}
    assert train["compare"]["ze-tp2/ze-dp2"]["max_abs_loss_diff"] < 1e-4 and train["compare"]["ze-tp2/ze-dp2"][
        "step_ratio_paired"] > 0
    mem = train["memory"]
    assert mem["full_param_elements"] == runs["ze-dp2"]["memory"]["local_param_elements"]
    assert 0.5 < mem["expected_params_ratio"] < 0.6 and 0 < mem["replicated_fraction"] < 0.2
    for kind in ("params", "grads"):  # each rank holds its halves of the split weights and all replicated ones
        assert math.isclose(mem["tp_over_dp"][kind], mem["expected_params_ratio"], rel_tol=1e-9), kind
    # ZeRO 1 splits the optimizer states over dp=2; tp=2 (dp=1) keeps all the states of its half
    assert math.isclose(mem["tp_over_dp"]["optimizer_states"], 2 * mem["expected_params_ratio"], rel_tol=1e-9)
    # tp=2's collectives in the engine: the same activation all-reduces as outside it
    tp_fwd = runs["ze-tp2"]["collectives"]["forward"]
    assert tp_fwd["all_reduce"][0] == 2 * train["model"]["layers"] + 1 and tp_fwd["all_gather"][0] == 1
    assert runs["ze-dp2"]["collectives"]["forward"] == {}
    assert result["deepspeed"] == {"skipped": "--no-deepspeed"}
