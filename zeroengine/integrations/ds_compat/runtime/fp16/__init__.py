"""``deepspeed.runtime.fp16``: only what DeepSpeed's checkpoint files name (see loss_scaler)."""
