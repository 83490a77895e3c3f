"""Integrations with the tools people train through.

- :mod:`zeroengine.integrations.as_deepspeed`: the ``ZEROENGINE_AS_DEEPSPEED`` switch, which makes
  ``import deepspeed`` (and transformers' and accelerate's availability checks) resolve to zeroengine.
- :mod:`zeroengine.integrations.ds_compat`: the ``deepspeed`` module tree those libraries import,
  built from zeroengine's own objects.
- :mod:`zeroengine.integrations.lightning`: ``ZeroEngineStrategy`` for PyTorch Lightning.

Importing this package imports nothing else: the switch runs at interpreter start-up.
"""
