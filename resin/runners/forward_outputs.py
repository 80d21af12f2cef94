"""Copies of a :class:`resin.ForwardOutput` with some fields replaced (the class is frozen).

Owns :data:`FIELDS`, the constructor's arguments in order, so a runner stage that adds to an
output (the MTP drafter's drafts, the prompt logprobs) or a rank that ships one through a pipe
lists them in one place.
"""

from __future__ import annotations

from typing import Any

from resin._core import ForwardOutput

FIELDS = (
    "token_ids",
    "token_indptr",
    "logprobs",
    "top_logprob_ids",
    "top_logprobs",
    "draft_token_ids",
    "draft_indptr",
    "prompt_logprobs",
    "prompt_top_logprob_ids",
    "prompt_top_logprobs",
)


def output_with(out: ForwardOutput, **changes: Any) -> ForwardOutput:
    """``out`` with the fields named in ``changes`` replaced (unknown names: TypeError)."""
    unknown = set(changes) - set(FIELDS)
    if unknown:
        raise TypeError(f"ForwardOutput has no field(s) {sorted(unknown)}")
    return ForwardOutput(
        *(changes[name] if name in changes else getattr(out, name) for name in FIELDS)
    )
