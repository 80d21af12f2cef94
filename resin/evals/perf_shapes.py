"""What ``resin bench`` measures: the shapes (decode batches, prefill chunks, end-to-end runs)
and the per-model perf spec (``perf.toml``) that lists them.

Owns the compact shape syntax, used on the command line (``--shapes``), in ``perf.toml`` and
as each shape's id in a report, so an id can be pasted back into ``--shapes``::

    decode:1,8,64@128,512     decode steps of B = 1, 8, 64 sequences, each with 128 and with
                              512 tokens already in the cache (every B x context pair)
    prefill:128,512           one prefill chunk of 128 (of 512) new tokens, empty cache
    e2e:8@64+32               8 requests of 64 prompt tokens generating 32 tokens each,
                              from an idle engine until all finish

Several groups are separated by spaces. ``perf.toml`` (``models/<name>/perf.toml``) holds::

    shapes = "decode:1,8,64,256@128,1024 prefill:128,512,2048 e2e:16@128+64"
    repeats = 10        # optional: timed repeats per shape
    warmup = 2          # optional: untimed repeats first
    threshold = 0.05    # optional: regression threshold (fraction of the baseline median)
    dtype = "bfloat16"  # optional: runner dtype
    device = "cuda"     # optional

Command-line options win over the file; the file wins over :data:`DEFAULT_SHAPES`.
Pure Python (``tomllib``), no torch.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ShapeKind = Literal["decode", "prefill", "e2e"]
KINDS: tuple[ShapeKind, ...] = ("decode", "prefill", "e2e")
DEFAULT_SHAPES = "decode:1,8,64,256@128,1024 prefill:128,512,2048 e2e:16@128+64"
SPEC_KEYS = ("shapes", "repeats", "warmup", "threshold", "dtype", "device")


@dataclass(frozen=True)
class Shape:
    """One measured configuration.

    decode: ``batch_size`` sequences, each with ``context_len`` tokens in the cache (the first
    timed step; later repeats add one token each). prefill: one chunk of ``num_tokens`` new
    tokens at context 0. e2e: ``batch_size`` requests of ``context_len`` prompt tokens that
    each generate ``num_output_tokens``.
    """

    kind: ShapeKind
    batch_size: int = 1
    context_len: int = 0
    num_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def id(self) -> str:
        if self.kind == "decode":
            return f"decode:{self.batch_size}@{self.context_len}"
        if self.kind == "prefill":
            return f"prefill:{self.num_tokens}"
        return f"e2e:{self.batch_size}@{self.context_len}+{self.num_output_tokens}"

    @property
    def max_len_tokens(self) -> int:
        """Longest sequence the shape creates before extra decode steps (prompt + outputs)."""
        if self.kind == "decode":
            return self.context_len
        if self.kind == "prefill":
            return self.num_tokens
        return self.context_len + self.num_output_tokens


@dataclass
class PerfSpec:
    """A model's perf settings: the shapes and (optionally) repeats, warm-up, threshold,
    dtype and device. ``None`` means "not set here"."""

    shapes: list[Shape] = field(default_factory=list)
    repeats: int | None = None
    warmup: int | None = None
    threshold: float | None = None
    dtype: str | None = None
    device: str | None = None
    source: str | None = None   # where it came from (a perf.toml path), for the report


def _ints(text: str, what: str, group: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise ValueError(f"shape {group!r}: {what} must be comma-separated integers, "
                         f"got {text!r}") from exc
    if not values or min(values) < 1:
        raise ValueError(f"shape {group!r}: {what} must be positive integers, got {text!r}")
    return values


def parse_shapes(spec: str) -> list[Shape]:
    """Parse the compact syntax (module doc) into shapes, in the order given, duplicates dropped.

    >>> [s.id for s in parse_shapes("decode:1,8@128 prefill:64 e2e:2@16+4")]
    ['decode:1@128', 'decode:8@128', 'prefill:64', 'e2e:2@16+4']
    """
    shapes: list[Shape] = []
    for group in spec.split():
        kind, sep, body = group.partition(":")
        if not sep or kind not in KINDS:
            raise ValueError(f"shape {group!r}: expected KIND:..., KIND one of {', '.join(KINDS)} "
                             "(e.g. decode:1,8@128 prefill:512 e2e:8@64+32)")
        if kind == "prefill":
            if "@" in body:
                raise ValueError(f"shape {group!r}: prefill takes chunk sizes only "
                                 "(prefill:128,512); chunks start from an empty cache")
            shapes += [Shape("prefill", num_tokens=n) for n in _ints(body, "chunk sizes", group)]
            continue
        batches, at, rest = body.partition("@")
        if not at:
            raise ValueError(f"shape {group!r}: expected {kind}:BATCHES@CONTEXTS "
                             f"(e.g. {'decode:1,8@128' if kind == 'decode' else 'e2e:8@64+32'})")
        if kind == "decode":
            for b in _ints(batches, "batch sizes", group):
                shapes += [Shape("decode", batch_size=b, context_len=c)
                           for c in _ints(rest, "context lengths", group)]
            continue
        prompt, plus, outputs = rest.partition("+")
        if not plus:
            raise ValueError(f"shape {group!r}: expected e2e:BATCHES@PROMPT+OUTPUT (e2e:8@64+32)")
        for b in _ints(batches, "batch sizes", group):
            for p in _ints(prompt, "prompt lengths", group):
                shapes += [Shape("e2e", batch_size=b, context_len=p, num_output_tokens=o)
                           for o in _ints(outputs, "output lengths", group)]
    if not shapes:
        raise ValueError("no shapes given (e.g. --shapes 'decode:1,8@128 prefill:512')")
    return list(dict.fromkeys(shapes))


def perf_spec_from_mapping(raw: Mapping[str, Any], source: str | None = None) -> PerfSpec:
    """A :class:`PerfSpec` from ``perf.toml``'s keys (module doc); unknown keys are errors."""
    where = source or "perf spec"
    unknown = sorted(set(raw) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {list(SPEC_KEYS)}")
    shapes = raw.get("shapes", "")
    if isinstance(shapes, list):
        shapes = " ".join(str(s) for s in shapes)
    if not isinstance(shapes, str):
        raise ValueError(f"{where}: 'shapes' must be a string like {DEFAULT_SHAPES!r}")
    spec = PerfSpec(shapes=parse_shapes(shapes) if shapes.strip() else [], source=source)
    for key, kind in (("repeats", int), ("warmup", int), ("threshold", (int, float)),
                      ("dtype", str), ("device", str)):
        if key in raw:
            if not isinstance(raw[key], kind) or isinstance(raw[key], bool):
                raise ValueError(f"{where}: '{key}' has the wrong type ({raw[key]!r})")
            setattr(spec, key, raw[key])
    return spec


def load_perf_spec(source: str | Path | Mapping[str, Any] | PerfSpec | None) -> PerfSpec:
    """Read a perf spec from a ``perf.toml`` path, a model directory holding one, an already
    parsed mapping, or pass a :class:`PerfSpec` through. ``None`` or a missing file: empty spec."""
    if source is None:
        return PerfSpec()
    if isinstance(source, PerfSpec):
        return source
    if isinstance(source, Mapping):
        return perf_spec_from_mapping(source)
    path = Path(source)
    if path.is_dir():
        path = path / "perf.toml"
    if not path.is_file():
        return PerfSpec()
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    return perf_spec_from_mapping(raw, source=str(path))
