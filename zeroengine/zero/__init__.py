"""ZeRO stages: one strategy object per stage, built by :func:`factory.build_zero_optimizer`."""
