"""Multi-process launcher: ``zeroengine`` CLI, hostfiles, and rank detection.

``detect_rank_env`` is what the engine's ``init_distributed`` calls to learn
its rank under zeroengine, torchrun, SLURM or OpenMPI. Nothing here imports
torch.
"""
from .rank_env import RankEnv, detect_rank_env

__all__ = ["RankEnv", "detect_rank_env"]
