"""Reusable staging buffers for collectives that need a temporary as large as their message.

On gloo, zeroengine builds reduce-scatter and all-gather from all_to_all_single
(see ``collectives._use_all_to_all``), which needs a full-size temporary per
call: the received chunks before they are summed, or this rank's chunk
repeated once per peer. Stage 3 issues such a call for every bucket in
forward, again in backward, and once more per gradient bucket, so allocating
each temporary afresh handed glibc a stream of equal-sized large blocks that
it keeps in its heap (resident memory grew well past the live state; see
``zeroengine.zero.host_memory``) and cost an allocation and page faults per
call. A buffer is taken here and given back once its collective has
completed, so each size is allocated about once per concurrently running
collective. The pool is :class:`zeroengine.buffer_pool.BufferPool`: at most
``SCRATCH_KEEP`` idle buffers, the largest, serving smaller requests as views.
"""
from __future__ import annotations

from zeroengine.buffer_pool import BufferPool

# Idle buffers kept: enough for the collectives a stage-3 step has in flight at once (prefetched gathers and
# the reduce-scatters of the buckets in flight); a burst beyond it allocates and frees the extra ones.
SCRATCH_KEEP = 6

scratch = BufferPool(keep=SCRATCH_KEEP)
