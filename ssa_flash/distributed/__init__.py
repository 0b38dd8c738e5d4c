"""Sequence parallelism: SSA, softmax and adaptive-temperature attention over a sequence sharded
across the ranks of a ``torch.distributed`` process group (ring attention; docs/design.md §1.5,
docs/distributed.md).

    import ssa_flash.distributed as sfd
    q, k, v = (sfd.shard_sequence(t, group, is_causal=True) for t in (q_full, k_full, v_full))
    out = sfd.ring_attention(q, k, v, group, is_causal=True, score="ssa", score_params={"b": b, "n": n})  # this shard
    out_full = sfd.unshard_sequence(out, group, is_causal=True)

* :func:`ring_attention`, :func:`shard_sequence`, :func:`unshard_sequence`,
  :func:`shard_positions` (``ring``), :class:`RingSSAttention` (``nn``);
* ``partial``: attention of queries over one key shard and the LSE merges of outputs and entropy
  statistics, on one process (the kernels' side of ring attention).

Not imported by ``import ssa_flash``.
"""
from . import partial
from .ring_module import RingSSAttention
from .ring import ring_attention, shard_positions, shard_sequence, unshard_sequence

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence", "shard_positions",
           "RingSSAttention", "partial"]
