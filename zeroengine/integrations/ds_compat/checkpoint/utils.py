"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``: copies that save only their own values.

accelerate calls it on a consolidated state_dict before ``torch.save``: a view (of a flat buffer, say)
would otherwise be saved with its whole storage."""
from __future__ import annotations

import torch


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """``item`` (a tensor, or lists / tuples / dicts of them) with every tensor cloned onto ``device``."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item
