"""zeroengine.parallel: the process mesh (data × tensor × pipeline) every parallel dimension is cut from."""
from .mesh import ProcessMesh, build_mesh, data_parallel_mesh, mesh_from_mpu

__all__ = ["ProcessMesh", "build_mesh", "data_parallel_mesh", "mesh_from_mpu"]
