"""What ``resin bench`` measures: the shapes (decode batches, prefill chunks, end-to-end runs)
and the per-model perf spec (``perf.toml``) that lists them.

Owns the compact shape syntax, used on the command line (``--shapes``), in ``perf.toml`` and
as each shape's id in a report, so an id can be pasted back into ``--shapes``::

    decode:1,8,64@128,512     decode steps of B = 1, 8, 64 sequences, each with 128 and with
                              512 tokens already in the cache (every B x context pair)
    prefill:128,512           one prefill chunk of 128 (of 512) new tokens, empty cache
    e2e:8@64+32               8 requests of 64 prompt tokens generating 32 tokens each,
                              from an idle engine until all finish

Several groups are separated by spaces. ``perf.toml`` (``models/<name>/perf.toml``, or a suite
under ``evals/perf/suites/`` passed with ``--spec``) holds the shapes either as one string or as
tables (the layout ``resin new-model`` renders), plus optional settings::

    shapes = "decode:1,8,64,256@128,1024 prefill:128,512,2048 e2e:16@128+64"
    repeats = 10        # timed repeats per shape
    warmup = 2          # untimed repeats first
    threshold = 0.05    # regression threshold (fraction of the baseline median)
    num_threads = 1     # CPU only: torch threads (steadier on a shared machine)

    [decode]            # every batch size x every context length
    batch_sizes = [1, 8, 64]
    context_lens = [128, 1024]
    [prefill]
    chunk_sizes = [128, 512]
    [e2e]               # every batch x prompt x output combination
    batch_sizes = [16]
    prompt_lens = [128]
    output_lens = [64]
    [reference]         # what to run (dtype/device may also be top-level keys)
    checkpoint = "tiny" # relative to the perf.toml's directory; default: the model's own
    dtype = "bfloat16"
    device = "cuda"
    [model]             # informational only; bench reads the checkpoint's config.json

Shapes from ``shapes`` and from the tables are concatenated. Command-line options win over the
file; the file wins over :data:`DEFAULT_SHAPES`. Unknown keys are errors (typos do not pass
silently).
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
SPEC_KEYS = ("shapes", "repeats", "warmup", "threshold", "dtype", "device", "num_threads")
# Table -> its keys; each shape table lists integer arrays whose product is the shape set.
SPEC_TABLES: dict[str, tuple[str, ...]] = {
    "decode": ("batch_sizes", "context_lens"),
    "prefill": ("chunk_sizes",),
    "e2e": ("batch_sizes", "prompt_lens", "output_lens"),
    "reference": ("checkpoint", "dtype", "device"),
    "model": (),  # informational: any keys
}


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
    dtype, device and CPU threads. ``None`` means "not set here"."""

    shapes: list[Shape] = field(default_factory=list)
    repeats: int | None = None
    warmup: int | None = None
    threshold: float | None = None
    dtype: str | None = None
    device: str | None = None
    num_threads: int | None = None
    checkpoint: Path | None = None  # resolved against the perf.toml's directory when read
    source: str | None = None  # where it came from (a perf.toml path), for the report


def _ints(text: str, what: str, group: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise ValueError(
            f"shape {group!r}: {what} must be comma-separated integers, got {text!r}"
        ) from exc
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
            raise ValueError(
                f"shape {group!r}: expected KIND:..., KIND one of {', '.join(KINDS)} "
                "(e.g. decode:1,8@128 prefill:512 e2e:8@64+32)"
            )
        if kind == "prefill":
            if "@" in body:
                raise ValueError(
                    f"shape {group!r}: prefill takes chunk sizes only "
                    "(prefill:128,512); chunks start from an empty cache"
                )
            shapes += [Shape("prefill", num_tokens=n) for n in _ints(body, "chunk sizes", group)]
            continue
        batches, at, rest = body.partition("@")
        if not at:
            raise ValueError(
                f"shape {group!r}: expected {kind}:BATCHES@CONTEXTS "
                f"(e.g. {'decode:1,8@128' if kind == 'decode' else 'e2e:8@64+32'})"
            )
        if kind == "decode":
            for b in _ints(batches, "batch sizes", group):
                shapes += [
                    Shape("decode", batch_size=b, context_len=c)
                    for c in _ints(rest, "context lengths", group)
                ]
            continue
        prompt, plus, outputs = rest.partition("+")
        if not plus:
            raise ValueError(f"shape {group!r}: expected e2e:BATCHES@PROMPT+OUTPUT (e2e:8@64+32)")
        for b in _ints(batches, "batch sizes", group):
            for p in _ints(prompt, "prompt lengths", group):
                shapes += [
                    Shape("e2e", batch_size=b, context_len=p, num_output_tokens=o)
                    for o in _ints(outputs, "output lengths", group)
                ]
    if not shapes:
        raise ValueError("no shapes given (e.g. --shapes 'decode:1,8@128 prefill:512')")
    return list(dict.fromkeys(shapes))


def _int_list(table: Mapping[str, Any], key: str, where: str) -> str:
    values = table.get(key)
    if (
        not isinstance(values, list)
        or not values
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    ):
        raise ValueError(f"{where}: '{key}' must be a non-empty list of integers, got {values!r}")
    return ",".join(str(v) for v in values)


def _table_shapes(raw: Mapping[str, Any], where: str) -> str:
    """The shape tables of a perf.toml, in the compact syntax."""
    groups = []
    if "decode" in raw:
        t = raw["decode"]
        groups.append(
            f"decode:{_int_list(t, 'batch_sizes', where + ' [decode]')}"
            f"@{_int_list(t, 'context_lens', where + ' [decode]')}"
        )
    if "prefill" in raw:
        groups.append(f"prefill:{_int_list(raw['prefill'], 'chunk_sizes', where + ' [prefill]')}")
    if "e2e" in raw:
        t, w = raw["e2e"], where + " [e2e]"
        groups.append(
            f"e2e:{_int_list(t, 'batch_sizes', w)}@{_int_list(t, 'prompt_lens', w)}"
            f"+{_int_list(t, 'output_lens', w)}"
        )
    return " ".join(groups)


def perf_spec_from_mapping(
    raw: Mapping[str, Any], source: str | None = None, base_dir: Path | None = None
) -> PerfSpec:
    """A :class:`PerfSpec` from ``perf.toml``'s keys and tables (module doc); unknown keys are
    errors. ``base_dir``: where a relative ``[reference] checkpoint`` points from."""
    where = source or "perf spec"
    unknown = sorted(set(raw) - set(SPEC_KEYS) - set(SPEC_TABLES))
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {unknown}; known: "
            f"{list(SPEC_KEYS)} and tables {list(SPEC_TABLES)}"
        )
    for table, keys in SPEC_TABLES.items():
        if table not in raw:
            continue
        if not isinstance(raw[table], Mapping):
            raise ValueError(f"{where}: '{table}' must be a table ([{table}])")
        extra = sorted(set(raw[table]) - set(keys)) if keys else []
        if extra:
            raise ValueError(f"{where}: unknown key(s) {extra} in [{table}]; known: {list(keys)}")
    shapes = raw.get("shapes", "")
    if isinstance(shapes, list):
        shapes = " ".join(str(s) for s in shapes)
    if not isinstance(shapes, str):
        raise ValueError(f"{where}: 'shapes' must be a string like {DEFAULT_SHAPES!r}")
    shapes = f"{shapes} {_table_shapes(raw, where)}".strip()
    spec = PerfSpec(shapes=parse_shapes(shapes) if shapes else [], source=source)
    settings = {**raw.get("reference", {}), **{k: v for k, v in raw.items() if k in SPEC_KEYS}}
    for key, kind in (
        ("repeats", int),
        ("warmup", int),
        ("threshold", (int, float)),
        ("dtype", str),
        ("device", str),
        ("num_threads", int),
        ("checkpoint", str),
    ):
        if key in settings:
            if not isinstance(settings[key], kind) or isinstance(settings[key], bool):
                raise ValueError(f"{where}: '{key}' has the wrong type ({settings[key]!r})")
            setattr(spec, key, settings[key])
    if spec.checkpoint is not None:
        checkpoint = Path(spec.checkpoint).expanduser()
        if not checkpoint.is_absolute() and base_dir is not None:
            checkpoint = base_dir / checkpoint
        spec.checkpoint = checkpoint
    return spec


def load_perf_spec(
    source: str | Path | Mapping[str, Any] | PerfSpec | None, base_dir: Path | None = None
) -> PerfSpec:
    """Read a perf spec from a ``perf.toml`` path, a model directory holding one, an already
    parsed mapping (``base_dir``: its directory), or pass a :class:`PerfSpec` through. ``None``
    or a missing file: empty spec."""
    if source is None:
        return PerfSpec()
    if isinstance(source, PerfSpec):
        return source
    if isinstance(source, Mapping):
        return perf_spec_from_mapping(source, base_dir=base_dir)
    path = Path(source)
    if path.is_dir():
        path = path / "perf.toml"
    if not path.is_file():
        return PerfSpec()
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    return perf_spec_from_mapping(raw, source=str(path), base_dir=path.parent)
