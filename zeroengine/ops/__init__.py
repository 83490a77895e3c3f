"""C++/CUDA ops built just in time (builder.py), and the optimizers that use them.

``zeroengine.ops.adam`` holds CPUAdam and FusedAdam; ``registry.all_builders()``
lists every op for ``ze_report`` and ``build_all``.
"""
