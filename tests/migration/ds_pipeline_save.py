"""Real DeepSpeed's pipeline run for the DeepSpeed-checkpoint tests (DeepSpeed 0.19.8 importable):

    python ds_pipeline_save.py ROOT ZERO_STAGE [ZERO_STAGE ...]

For each ZeRO stage, 2 ranks, 2 pipeline stages: train TRAIN_STEPS batches, save_checkpoint(ROOT/pipe_<stage>) (per-layer files and
one mp_rank file set per stage), then loads it back and trains CONTINUE_STEPS more; rank 0 writes
ROOT/pipe_<stage>.json (losses after loading, full parameters at the end).
"""
import json
import os
import socket
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds_checkpoint_common as common  # noqa: E402


def _engine(zero_stage: int):
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    torch.manual_seed(0)
    module = PipelineModule(layers=common.pipeline_layers(LayerSpec), num_stages=2, loss_fn=common.pipeline_loss,
                            partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()),
                                           config=common.pipeline_config(zero_stage))
    return engine


def _rank(rank: int, world: int, port: int, root: str, zero_stages: list) -> None:
    deepspeed = common.join_world(rank, world, port)
    deepspeed.init_distributed("gloo")
    for zero_stage in zero_stages:
        folder = os.path.join(root, f"pipe_{zero_stage}")
        engine = _engine(zero_stage)
        common.pipeline_train(engine, 0, common.TRAIN_STEPS)
        engine.save_checkpoint(folder)
        engine.load_checkpoint(folder)  # (back into the engine that saved it: DeepSpeed's own continuation)
        record = {"losses": common.pipeline_train(engine, common.TRAIN_STEPS, common.CONTINUE_STEPS),
                  "params": common.pipeline_parameters(engine)}
        if rank == 0:
            with open(folder + ".json", "w") as f:
                json.dump(record, f)
    common.leave_world()


if __name__ == "__main__":
    root, zero_stages = sys.argv[1], [int(s) for s in sys.argv[2:]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, root, zero_stages), nprocs=2)
