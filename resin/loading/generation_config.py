"""Check a checkpoint's ``generation_config.json`` at load, before it becomes request defaults.

Owns :func:`check_generation_config`: the sampling fields Resin takes from the file as every
request's defaults (``resin.tokenizer.SAMPLING_FIELDS``) and its ``eos_token_id`` must be
what transformers' ``GenerationConfig`` means by them. A wrong one is refused here, with a
:class:`ConfigError` naming the file and the field, rather than failing every request later (a
server would answer each with an error blaming the client). Per field:

- ``temperature``, ``top_p``, ``min_p``, ``repetition_penalty``: a number; ``top_k``,
  ``max_new_tokens``: an int. transformers stores any value unchecked but its sampling code
  then fails on a string (``temperature > 0`` on ``"hot"``), so a wrong type is refused; the
  value must also be one ``resin.SamplingParams`` accepts (e.g. ``top_p`` in (0, 1]).
- ``null`` for any of them: transformers' "not set"; ignored (the default applies).
- ``eos_token_id``: an int or a list of ints (or null).

Other fields are not read by Resin and not checked. Imports ``resin._core`` only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from resin.loading.fields import ConfigError, read_json_object

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json field -> the resin.SamplingParams argument it is the default of.
NUMBER_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
INT_FIELDS = {"top_k": "top_k", "max_new_tokens": "max_tokens"}


def check_generation_config(checkpoint_dir: str | Path) -> None:
    """ConfigError naming ``generation_config.json`` and the field when one the engine uses is
    malformed (see the module doc); nothing when the file is absent."""
    path = Path(checkpoint_dir) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return
    raw = read_json_object(path)
    for name, target in {**NUMBER_FIELDS, **INT_FIELDS}.items():
        value = raw.get(name)
        if value is None:
            continue
        wanted = "an int" if name in INT_FIELDS else "a number"
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not is_number or (name in INT_FIELDS and not isinstance(value, int)):
            raise ConfigError(f"{path}: field {name!r} must be {wanted}, got {value!r}")
        _check_sampling_value(path, name, target, value)
    eos = raw.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    if eos is not None and not all(_is_token_id(i) for i in ids):
        raise ConfigError(
            f"{path}: field 'eos_token_id' must be a token id (a non-negative int) or a list "
            f"of them, got {eos!r}"
        )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_sampling_value(path: Path, name: str, target: str, value: float) -> None:
    """The value as ``resin.SamplingParams`` validates it for every request."""
    from resin._core import SamplingParams

    arguments: dict[str, Any] = {target: value}
    try:
        SamplingParams(**arguments)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ConfigError(
            f"{path}: field {name!r} is {value!r}, which sampling refuses ({exc})"
        ) from None
