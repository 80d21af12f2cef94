"""Scratch memory for the torch sampler: :class:`Workspace` hands out tensors it reuses across
steps, one per name.

Owns nothing but memory. The guarantee: a tensor from :meth:`Workspace.get` is valid until the
next ``get`` of the same name; two names never share memory. On a CPU a step writes into pages
it has touched before (on the VMs Resin is benchmarked on, a fresh 100 MB tensor costs about
three times a reused one: the page faults); on other devices ``get`` allocates a fresh tensor,
because the framework's caching allocator already reuses memory and a buffer held here would
be invisible to the runner's memory budget.

The sampler's names: ``sampler.processed`` (the step's copy of the logits), ``rows`` (whole
rows divided by their temperature, for one stage at a time), ``probs`` / ``cdf`` (their
softmax and cumulative sum), ``draw.again_rows`` (the rows a narrow candidate search left
undecided), ``filters.wide_rows``, ``candidates.*`` (a quarter of the rows and less),
``sampler.logprobs``: at most about six times the largest step's logits, held between steps.

Imports torch; ``import resin`` does not import this module.
"""

from __future__ import annotations

import math

import torch


class Workspace:
    """Named scratch tensors, each grown to the largest size asked for (never shrunk)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.reuse = self.device.type == "cpu"
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of ``shape`` and ``dtype``: a view of the buffer
        ``name`` (valid until the next ``get(name, ...)``), or a fresh tensor off the CPU."""
        if not self.reuse:
            return torch.empty(shape, dtype=dtype, device=self.device)
        numel = math.prod(shape)
        buffer = self._buffers.get((name, dtype))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=self.device)
            self._buffers[(name, dtype)] = buffer
        return buffer[:numel].view(shape)

    @property
    def num_bytes(self) -> int:
        """The memory the workspace holds."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
