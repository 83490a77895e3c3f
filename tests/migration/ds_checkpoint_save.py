"""Real DeepSpeed's side of the DeepSpeed-checkpoint tests: run with DeepSpeed 0.19.8 importable.

    python ds_checkpoint_save.py ROOT WORLD CASE [CASE ...]       (CASE: stage:precision, e.g. 2:bf16)

For each case, in one world of WORLD gloo ranks: train TRAIN_STEPS steps and save_checkpoint(ROOT/CASE)
(with a client_state); then loads that checkpoint back and trains CONTINUE_STEPS more. Rank 0
writes ROOT/CASE.json: the losses, lrs and full parameters after continuing, which zeroengine must match
when it loads the same checkpoint; and, for the ZeRO cases, ROOT/fp32/CASE.pt: DeepSpeed's own zero_to_fp32 of
the checkpoint.
"""
import json
import os
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds_checkpoint_common as common  # noqa: E402


def _allow_fp16_on_cpu():
    """DeepSpeed's CPU accelerator refuses fp16 ("not supported on your device"); torch runs it on CPU."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: True
    accelerator.supported_dtypes = lambda: [torch.float, torch.half, torch.bfloat16]


def _engine(case: str, world: int):
    import deepspeed

    stage, precision = case.split(":")
    torch.manual_seed(0)
    model = common.Net()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=common.param_groups(model),
                                           config=common.config(int(stage), precision, world))
    return engine


def _rank(rank: int, world: int, port: int, root: str, cases: list) -> None:
    deepspeed = common.join_world(rank, world, port)
    _allow_fp16_on_cpu()
    for case in cases:
        folder = os.path.join(root, case.replace(":", "_"))
        engine = _engine(case, world)
        common.train(engine, 0, common.TRAIN_STEPS, rank, world)
        # (universal_checkpoint_info: what ds_to_universal requires of a checkpoint it converts)
        engine.save_checkpoint(folder, client_state={"note": "from deepspeed", "seen": torch.arange(4),
                                                     "universal_checkpoint_info": {}})
        # DeepSpeed's continuation from its own checkpoint: loaded back into the engine that saved it (a fresh
        # engine would cost an initialization per case and load the same)
        _, client_state = engine.load_checkpoint(folder)
        record = common.train(engine, common.TRAIN_STEPS, common.CONTINUE_STEPS, rank, world)
        record["params"] = common.full_parameters(engine, deepspeed.zero.GatheredParameters)
        record["client_note"] = client_state["note"]
        if rank == 0:
            with open(folder + ".json", "w") as f:
                json.dump(record, f)
            if not case.startswith("0:"):  # (zero_to_fp32 reads ZeRO checkpoints only)
                from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

                state = get_fp32_state_dict_from_zero_checkpoint(folder)
                os.makedirs(os.path.join(root, "fp32"), exist_ok=True)
                torch.save({k: v.clone() for k, v in state.items()},
                           os.path.join(root, "fp32", os.path.basename(folder) + ".pt"))
    common.leave_world()


if __name__ == "__main__":
    root, world, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(world, port, root, cases), nprocs=world)
