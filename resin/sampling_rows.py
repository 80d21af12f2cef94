"""The rows the torch sampler reads whole: :class:`ScaledRows` (a batch's rows divided by
their temperature, made only for the rows that need the whole vocabulary) and the whole-row
operations on them (:func:`softmax_into`, :func:`keep_from_`, :func:`padded`).

Guarantee: every value is the one dividing the whole batch first would give (a division is
elementwise), and every operation has the bits of the plain one (``softmax`` and
``masked_fill`` of the same rows), written into reused buffers where it can.

Imports torch; ``import resin`` does not import this module.
"""

from __future__ import annotations

import torch

from resin.sampling_workspace import Workspace


class ScaledRows:
    """The rows of ``logits / temperature`` (``logits`` [S, V]; ``temperature`` float32 [S], or
    None when ``logits`` are already scaled), made on demand for the rows that need the whole
    vocabulary: the filters find most thresholds among a row's candidates alone.

    With ``owned`` (``logits`` are the caller's scratch copy) consecutive rows are divided in
    place when first needed and their ``temperature`` becomes 1, so later readers (a later
    :meth:`take`, a second search over ``logits``' rows with ``temperature``) see the same
    scaled values without dividing twice."""

    def __init__(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor | None,
        workspace: Workspace,
        owned: bool = False,
    ) -> None:
        self.logits, self.temperature, self.workspace = logits, temperature, workspace
        self.owned = owned

    @property
    def vocab_size(self) -> int:
        return int(self.logits.shape[1])

    def scale(self, values: torch.Tensor, at: torch.Tensor | None = None) -> torch.Tensor:
        """``values`` [n, m] (of the rows ``at``, all when None) divided by their temperature;
        the division is elementwise, so it gives the bits a division of the whole row does."""
        if self.temperature is None:
            return values
        temperature = self.temperature if at is None else self.temperature[at]
        return values / temperature[:, None]

    def take(
        self, at: torch.Tensor, name: str, writable: bool = True, last: bool = False
    ) -> torch.Tensor:
        """The rows ``at`` int64 [n] (ascending), scaled, [n, V]: a view of ``logits`` where
        the rows are consecutive and either nothing divides them (``writable=False``) or they
        are ``owned`` (divided in place) and the caller reads them ``last`` or not at all for
        writing; else the workspace buffer ``name``."""
        span = row_span(at)
        if span is not None:
            lo, hi = span
            if self.owned and (last or not writable):
                self._scale_in_place(lo, hi)
                return self.logits[lo:hi]
            temperature = self._divisor(self.temperature, lo, hi)
            if temperature is None and not writable:
                return self.logits[lo:hi]
            out = self.workspace.get(name, (len(at), self.vocab_size), self.logits.dtype)
            if temperature is None:
                return out.copy_(self.logits[lo:hi])
            return torch.div(self.logits[lo:hi], temperature[:, None], out=out)
        out = self.workspace.get(name, (len(at), self.vocab_size), self.logits.dtype)
        torch.index_select(self.logits, 0, at, out=out)
        if self.temperature is not None:
            temperature = self.temperature[at]
            if not bool((temperature == 1).all()):
                out.div_(temperature[:, None])
        return out

    @staticmethod
    def _divisor(temperature: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
        """Rows ``lo:hi``'s temperatures, None when there is nothing to divide by (x / 1 = x)."""
        if temperature is None or bool((temperature[lo:hi] == 1).all()):
            return None
        return temperature[lo:hi]

    def _scale_in_place(self, lo: int, hi: int) -> None:
        """Divide rows ``lo:hi`` of ``logits`` in place, each run of rows whose temperature is
        not 1 at once (the Sampler puts a block's temperature-1 rows first: one run)."""
        temperature = self._divisor(self.temperature, lo, hi)
        if temperature is None or self.temperature is None:
            return
        dividing = (temperature != 1).tolist() + [False]
        start = None
        for i, divide in enumerate(dividing):
            if divide and start is None:
                start = i
            elif not divide and start is not None:
                self.logits[lo + start : lo + i].div_(temperature[start:i, None])
                start = None
        self.temperature = self.temperature.clone()  # the caller's stays as it was
        self.temperature[lo:hi] = 1


def row_span(at: torch.Tensor) -> tuple[int, int] | None:
    """``(lo, hi)`` when the ascending row indices ``at`` are ``lo, lo + 1, .. hi - 1``."""
    if len(at) == 0:
        return None
    lo, last = int(at[0]), int(at[-1])
    return (lo, last + 1) if last - lo + 1 == len(at) else None


def softmax_into(logits: torch.Tensor, workspace: Workspace, name: str) -> torch.Tensor:
    """``logits.softmax(dim=-1)`` (the same kernel, the same bits) written into the workspace
    buffer ``name``."""
    out = workspace.get(name, tuple(logits.shape), logits.dtype)
    return torch.ops.aten._softmax.out(logits, -1, False, out=out)  # type: ignore[no-any-return]


def keep_from_(rows: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``rows`` [n, V] with the logits below their row's ``threshold`` [n] set to ``-inf``, in
    place: ``masked_fill_(rows < threshold)``'s values in one pass a row (``threshold_`` keeps
    x > the float just below the threshold, i.e. x >= it) instead of a mask and a fill."""
    below = torch.nextafter(threshold, threshold.new_full((), -torch.inf))
    for row, cut in zip(rows, below.tolist()):
        torch.threshold_(row, cut, -torch.inf)
    return rows


def padded(values: torch.Tensor, width: int, fill: float | int) -> torch.Tensor:
    """``values`` [n, m] widened to [n, width] (m <= width) with ``fill``."""
    if values.shape[1] == width:
        return values
    out = values.new_full((values.shape[0], width), fill)
    out[:, : values.shape[1]] = values
    return out
