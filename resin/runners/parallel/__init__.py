"""Parallel runners on ``torch.distributed``: one Rust engine, the plan handed to every rank.

- :mod:`.sharding` — which slice of each tensor a tensor-parallel rank holds, read as slices;
- :mod:`.tensor_parallel` — a rank's runner: the built-in model on its shard, with the
  all-reduce / vocab-parallel collectives;
- :mod:`.plan_transport` — each step's plan to the other ranks through shared memory;
- :mod:`.launcher` — :class:`TensorParallelRunner`, the process model (rank 0 in the engine's
  process, spawned workers for the others, failures surfaced as errors).

Importing this package imports torch (it is not imported by ``import resin``).
"""

from resin.runners.parallel.launcher import RankFailure, TensorParallelRunner

__all__ = ["RankFailure", "TensorParallelRunner"]
