"""zeroengine's Muon is DeepSpeed 0.19.8's: its Newton-Schulz functions, ``muon_update`` and three steps of its
single-device MuonWithAuxAdam (what its stage 0 steps) give bitwise the same numbers in fp32, run beside the test
anchor in a subprocess (tests/migration/ds_muon_trajectory.py). ZeRO stages 1-3 and offload are held to the same
math by tests/distributed/test_matrix_optimizers.py."""
import json

from test_deepspeed_checkpoints import run_deepspeed


def test_muon_math_and_trajectory_equal_deepspeeds():
    done = run_deepspeed("ds_muon_trajectory.py", timeout=120)
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert len(result) == 18
    assert all(diff == 0.0 for diff in result.values()), result
