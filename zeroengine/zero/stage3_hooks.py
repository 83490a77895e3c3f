"""Stage 3's module hooks: gather parameters just before a module runs, free them right after.

For every module that directly owns sharded parameters:

* forward pre-hook: gather the buckets holding those parameters;
* forward post-hook: release them (a module called twice gathers twice), and
  when autograd will come back through this module, register a hook on its
  outputs that gathers them again just before its backward runs;
* the gradient store calls :meth:`Stage3Hooks.on_bucket_grads_ready` once every
  gradient of a bucket exists, which releases it: after that no backward
  computation needs those parameters (autograd has accumulated every use).

Tied parameters (GPT-2's embedding and head) live in the bucket of their
first owner; any module using them gathers that bucket.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from .layout import Bucket, FlatLayout
from .partitioned_params import PartitionedParamBuffer


class Stage3Hooks:
    def __init__(self, module: torch.nn.Module, params: PartitionedParamBuffer, layout: FlatLayout):
        self.params = params
        self.layout = layout
        self.in_use: dict[int, int] = defaultdict(int)
        index_of = {id(p): i for i, p in enumerate(params.params)}
        bucket_of = layout.bucket_of_param()
        self.handles = []
        for m in module.modules():
            owned = {bucket_of[index_of[id(p)]] for p in m._parameters.values() if p is not None and id(p) in index_of}
            if not owned:
                continue
            buckets = [layout.buckets[b] for b in sorted(owned)]
            self.handles.append(m.register_forward_pre_hook(self._pre_forward(buckets)))
            self.handles.append(m.register_forward_hook(self._post_forward(buckets)))

    def _pre_forward(self, buckets: list[Bucket]):
        def hook(_module, _args):
            for b in buckets:
                self.params.gather(b)
                self.in_use[b.index] += 1

        return hook

    def _post_forward(self, buckets: list[Bucket]):
        def hook(_module, _args, output):
            for b in buckets:
                self.in_use[b.index] -= 1
                if self.in_use[b.index] == 0:
                    self.params.release(b)
            if torch.is_grad_enabled():
                outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
                if outputs:
                    register_multi_grad_hook(outputs, lambda _grads: self._pre_backward(buckets), mode="any")

        return hook

    def _pre_backward(self, buckets: list[Bucket]) -> None:
        for b in buckets:
            self.params.gather(b)

    def on_bucket_grads_ready(self, bucket: Bucket) -> None:
        if self.in_use[bucket.index] == 0:
            self.params.release(bucket)

    def release_all(self) -> None:
        """End of backward: anything still gathered (frozen paths, unused outputs) is freed."""
        for bucket in self.layout.buckets:
            if self.in_use[bucket.index] == 0:
                self.params.release(bucket)
