"""The gated MLP's activation by a config's ``hidden_act``, for any framework's runner.

Owns the lookup and its error: each runner keeps its own table of functions (torch in
:mod:`resin.runners.torch.layers`, MLX in :mod:`resin.runners.mlx.layers`, both keyed by
transformers' ``ACT2FN`` names), and :func:`gate_activation` picks from it or refuses the name,
listing the supported ones — never a silent SiLU. Imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

Activation = TypeVar("Activation")


def gate_activation(hidden_act: str, table: Mapping[str, Activation]) -> Activation:
    """``table[hidden_act]``; ``ValueError`` naming the value and ``table``'s names otherwise."""
    try:
        return table[hidden_act]
    except KeyError:
        raise ValueError(
            f"hidden_act {hidden_act!r} is not supported by the gated MLP; "
            f"supported: {', '.join(table)}"
        ) from None
