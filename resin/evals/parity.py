"""The parity harness: does a Runner compute what the HF ``transformers`` reference computes?

``run_parity(model_dir)`` loads the checkpoint twice — as ``transformers.AutoModelForCausalLM``,
or ``AutoModelForImageTextToText`` for a multimodal wrapper config that has no causal-LM class
(its text-only forward; :mod:`resin.scaffold.hf_model`), with eager attention, on CPU, in the
runner's dtype (float32 by default) — and through a Runner (the torch reference runner unless
``runner_factory`` says otherwise) — and checks, in order:

1. ``layers``: one prefill of one prompt through a one-request :class:`resin.Engine` step with
   the runner's capture hook on, against forward hooks on the HF model. Checkpoints, in HF's
   execution order: ``embed_tokens``; per layer every direct child module of the HF layer
   (Llama: ``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``; Gemma 3
   adds its feed-forward norms), the layer output; ``norm``. The first checkpoint whose scaled
   error exceeds tolerance is named (layer and sub-module); checkpoints the runner does not
   emit are listed as missing.
2. ``logits``: logits and log-probs at every prompt position (max abs diff, top-1 agreement,
   top-k log-prob diff), and the top-k log-probs the engine returns for the first sampled token.
3. ``greedy/*``: greedy tokens through the full engine, all prompts in one batch, against an
   HF greedy loop, under stress settings (page sizes 1/16/64, chunked prefill, a prefix-cache
   second pass, a pool small enough to force preemption).

Error measure (documented in ``docs/parity.md``): ``scaled = max|runner - hf| / max(1, max|hf|)``,
so fp32 rounding (~1e-6 on O(1) activations) sits far below the default 1e-4 whatever the
activation magnitude. torch/transformers are imported inside functions only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from resin.evals.parity_engine import (
    REFERENCE_CRASHED,
    UNRESOLVED_SPACINGS,
    GreedyReference,
    cached_vs_full_forward,
    crash_detail,
    exception_text,
    greedy_stages_or_reference_failure,
    reference_failed_stages,
    runner_capture_prefill,
)

# Mixtral before transformers 5 calls its MoE block ``block_sparse_moe``; runners say ``mlp``.
CHILD_ALIASES = {"block_sparse_moe": "mlp"}
DEFAULT_PROMPT_LENS = (1, 7, 16, 23, 48, 70)
SHARED_PREFIX_TOKENS = 32
TOP_K = 5
CHECKS = ("layers", "greedy")


@dataclass
class Tolerances:
    """Pass thresholds. ``hidden``/``logits``: scaled error (see module doc); ``logprobs``: abs
    diff of top-k log-probs, in float32 beyond what the position's own logit difference
    explains (twice it, as far as ``logits`` allows at that position's magnitude: a log-prob is
    a logit less the log-sum-exp); ``tie_margin``: an HF top-1/top-2 logit
    gap below this makes a greedy mismatch a near-tie (reported, not failed; that request is
    compared no further)."""

    hidden: float = 1e-4
    logits: float = 1e-4
    logprobs: float = 1e-3
    tie_margin: float = 1e-3
    # The dtype's relative spacing (bfloat16 2^-7, float16 2^-10; 0 for float32): a logit of
    # magnitude M is one spacing, ``resolution * M``, from its neighbours (a bf16 logit of 40:
    # 0.25, past a fixed 0.1 limit for any kernel but a bit-exact one). A log-prob and a
    # top-1/top-2 gap are each a difference of two such values, each held to two spacings
    # (torch.testing's bf16 rtol, 1.6e-2, is two), so their limits are at least four spacings
    # of the largest logit there. Not settable in parity.toml.
    resolution: float = 0.0

    @classmethod
    def for_dtype(cls, dtype: str) -> Tolerances:
        """Defaults for the runner's dtype (``float32``, ``bfloat16``, ``float16``)."""
        if "bfloat16" in dtype:
            return cls(hidden=5e-2, logits=5e-2, logprobs=1e-1, tie_margin=1e-1, resolution=2**-7)
        if "float16" in dtype:
            return cls(hidden=1e-2, logits=1e-2, logprobs=2e-2, tie_margin=2e-2, resolution=2**-10)
        return cls()

    def unresolved(self, magnitude: Any) -> Any:
        """What the dtype does not resolve in a log-prob or a logit gap at logits of
        ``magnitude`` (a float or a tensor): the floor of both limits below."""
        return UNRESOLVED_SPACINGS * self.resolution * magnitude

    def logprob_limit(self, magnitude: float) -> float:
        """The top-k log-prob limit where the largest logit's magnitude is ``magnitude``."""
        return max(self.logprobs, self.unresolved(magnitude))

    def tie_limit(self, magnitude: float) -> float:
        """The near-tie margin where the top-1 logit's magnitude is ``magnitude``."""
        return max(self.tie_margin, self.unresolved(magnitude))


@dataclass
class StageResult:
    """One check. ``first_mismatch`` locates the first failure (fields depend on the stage)."""

    name: str
    passed: bool
    detail: str = ""
    first_mismatch: dict[str, Any] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParityReport:
    """Everything one harness run found; ``passed`` iff every stage passed."""

    model_dir: str
    runner: str
    dtype: str
    tolerances: Tolerances
    layers: list[dict[str, Any]] = field(default_factory=list)
    stages: list[StageResult] = field(default_factory=list)
    # Why the HF reference could not be computed (load or forward raised), or None.
    reference_error: str | None = None
    # What the harness found about the reference itself (HF's cached decode departing from its
    # full forward): notes for the HF maintainers, not failures of the runner.
    reference_findings: list[dict[str, Any]] = field(default_factory=list)
    # HF's attention implementation the reference ran (:func:`hf_attention_for`).
    hf_attention: str = "eager"
    # What the model directory's ``reference.py`` changed in the HF reference
    # (:func:`adjust_reference`), as text.
    reference_adjustments: list[str] = field(default_factory=list)
    # How the prompts meet the checkpoint's supported length (:func:`length_limit`,
    # :func:`fit_prompts`), as text; empty when they fit.
    prompt_notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.stages) and all(s.passed for s in self.stages)

    def stage(self, name: str) -> StageResult:
        """The stage called ``name``; KeyError if it did not run."""
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage {name!r}; ran: {[s.name for s in self.stages]}")

    @property
    def first_departure(self) -> dict[str, Any] | None:
        """The first layer checkpoint beyond tolerance, or None."""
        return next((row for row in self.layers if not row["passed"]), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_dir": self.model_dir,
            "runner": self.runner,
            "dtype": self.dtype,
            "passed": self.passed,
            "tolerances": asdict(self.tolerances),
            "first_departure": self.first_departure,
            "layers": self.layers,
            "stages": [asdict(s) for s in self.stages],
            "reference_error": self.reference_error,
            "reference_findings": self.reference_findings,
            "hf_attention": self.hf_attention,
            "reference_adjustments": self.reference_adjustments,
            "prompt_notes": self.prompt_notes,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=_json_default)

    def summary(self) -> str:
        lines = [
            f"parity {'PASS' if self.passed else 'FAIL'}: {self.model_dir} "
            f"(runner {self.runner}, {self.dtype}"
            + ("" if self.hf_attention == "eager" else f", HF {self.hf_attention} attention")
            + ")"
        ]
        for s in self.stages:
            line = f"  [{'pass' if s.passed else 'FAIL'}] {s.name}: {s.detail}"
            if s.first_mismatch and not s.passed:
                line += "  first mismatch: " + ", ".join(
                    f"{k}={_short(v)}" for k, v in s.first_mismatch.items()
                )
            lines.append(line)
        for finding in self.reference_findings:
            lines.append(f"  [note] reference: {finding['finding']}")
        for adjustment in self.reference_adjustments:
            lines.append(f"  [note] reference adjusted: {adjustment}")
        for note in self.prompt_notes:
            lines.append(f"  [note] prompts: {note}")
        return "\n".join(lines)


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def default_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Seeded random token ids: lengths ``DEFAULT_PROMPT_LENS`` plus one prompt sharing the
    first ``SHARED_PREFIX_TOKENS`` tokens of the 48-token one (a prefix shared inside a batch)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab_size, n).tolist() for n in DEFAULT_PROMPT_LENS]
    base = prompts[DEFAULT_PROMPT_LENS.index(48)]
    prompts.append(base[:SHARED_PREFIX_TOKENS] + rng.integers(0, vocab_size, 9).tolist())
    return prompts


MIN_FITTED_PROMPT = 8
"""Default prompts are not shortened below this many tokens (too little to test): they run
past the supported length then, with a note."""


def length_limit(runner: Any) -> tuple[int, str] | None:
    """(longest sequence in tokens, why) where the runner gives transformers' results: a model
    directory's ``max_model_len_limit`` (Phi-3 longrope: the original length; a ``dynamic``
    rope), else a built-in family's rope (:func:`~resin.loading.rope.rope_length_limit`); None
    for no limit. ``resin.LLM`` serves no further (its ``max_model_len`` check)."""
    from resin.loading.rope import RopeConfig, rope_length_limit

    limit = getattr(runner, "max_model_len_limit", None)
    if limit is not None:
        return int(limit[0]), str(limit[1])
    rope = getattr(getattr(runner, "config", None), "rope", None)
    return rope_length_limit(rope) if isinstance(rope, RopeConfig) else None


def fit_prompts(
    prompts: list[list[int]], max_new_tokens: int, limit: tuple[int, str], given: bool
) -> tuple[list[list[int]], str | None]:
    """``prompts`` fitted to ``limit`` and a note for the report (None: they fit). Past the
    limit the reference and the runner compute different things by design (a departure there
    is no bug), so the default prompts (``given`` False) are cut to fit; prompts the caller
    gave, or defaults with room for fewer than :data:`MIN_FITTED_PROMPT` tokens, run as they
    are, and the note says where the comparison leaves what Resin serves."""
    longest, why = limit
    room = longest - max_new_tokens
    if all(len(p) <= room for p in prompts):
        return prompts, None
    if not given and room >= MIN_FITTED_PROMPT:
        note = (
            f"shortened to {room} tokens (+ {max_new_tokens} generated): the checkpoint's "
            f"supported length is {longest} ({why})"
        )
        return [p[:room] for p in prompts], note
    worst = max(map(len, prompts))
    return prompts, (
        f"{worst} tokens + {max_new_tokens} generated run past the checkpoint's supported "
        f"length {longest} ({why}); a departure there is transformers' rule, not a runner "
        "bug, and resin.LLM serves no further"
    )


def _encode_prompts(model_dir: Path, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    tokenizer = None
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                from resin.tokenizer import Tokenizer

                tokenizer = Tokenizer.from_pretrained(model_dir)
            out.append(tokenizer.encode(p))
        else:
            out.append([int(t) for t in p])
    return out


def default_runner_factory(model_dir: str | Path, dtype: str = "float32") -> Any:
    """The torch reference runner on CPU, in ``dtype``, on the parity attention backend
    (``PARITY_BACKEND``, as ``resin eval parity`` runs it; a server's default backend is
    another)."""
    import torch

    from resin.runners.torch import TorchRunner
    from resin.runners.torch.attention import PARITY_BACKEND

    return TorchRunner.from_pretrained(
        model_dir, device="cpu", dtype=getattr(torch, dtype), attention_backend=PARITY_BACKEND
    )


def load_hf_model(model_dir: str | Path, dtype: str = "float32", attention: str = "eager") -> Any:
    """The HF reference: CPU, eval mode, in ``dtype`` (the runner's), with HF's ``attention``
    implementation (``eager`` or ``sdpa``: :func:`hf_attention_for`). The causal-LM class, else
    a wrapper's image-text-to-text class (:func:`resin.scaffold.hf_model.from_pretrained`)."""
    import torch

    from resin.scaffold.hf_model import from_pretrained

    model = from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation=attention)
    return model.eval()


HF_ATTENTION = ("auto", "eager", "sdpa")


def hf_attention_for(runner: Any, requested: str = "auto") -> str:
    """Which of HF's attention implementations the reference runs for ``runner``: ``requested``
    unless ``auto``. ``auto``: ``sdpa`` for a built-in-family torch runner on a backend other
    than the parity one (``torch``, ``triton``, ``flashinfer``: each computes the softmax and
    both products with float32 accumulation, rounding once, as torch's SDPA, HF's default,
    does; HF's ``eager`` rounds the scores and the probabilities to the runner's dtype on
    the way, which in bf16 is a different answer, not a more exact one); ``eager`` otherwise
    (the reference backend mirrors eager op for op, and model directories and MLX are checked
    against eager, whose masks carry every model's features: sinks, softcapping)."""
    if requested not in HF_ATTENTION:
        raise ValueError(f"hf_attention {requested!r}: expected one of {HF_ATTENTION}")
    if requested != "auto":
        return requested
    from resin.runners.torch import TorchRunner
    from resin.runners.torch.attention import PARITY_BACKEND

    backend = getattr(getattr(runner, "attention_backend", None), "name", PARITY_BACKEND)
    return "sdpa" if type(runner) is TorchRunner and backend != PARITY_BACKEND else "eager"


def adjust_reference(runner: Any, model: Any) -> list[str]:
    """Apply the runner's model directory's ``reference.py`` (``adjust_reference(model) ->
    list[str]``) to the HF reference ``model``, in place, and return what it changed; ``[]``
    without one. For a rule HF leaves to chance that the runner must fix (GLM-5.3-Flash: the
    indexer's top-k ties, which torch orders by the call's size), so both compute the same
    thing; every adjustment is named in the report."""
    # (a tensor-parallel launcher keeps the model directory's runner as ``local``)
    model_dir = getattr(runner, "model_dir", None) or getattr(
        getattr(runner, "local", None), "model_dir", None
    )
    if model_dir is None or not (Path(model_dir) / "reference.py").is_file():
        return []
    from resin.evals.model_ref import import_model_module

    module = import_model_module(Path(model_dir), "reference")
    return list(module.adjust_reference(model))


def hf_vocab_size(model: Any) -> int:
    """The reference's vocabulary: its text config's ``vocab_size`` (a wrapper's top level
    has none)."""
    from resin.scaffold.hf_model import text_config

    return int(text_config(model.config).vocab_size)


def hf_num_layers(model: Any) -> int:
    """Decoder layers of the reference's stack (:func:`resin.scaffold.hf_model.decoder_stack`)."""
    from resin.scaffold.hf_model import decoder_stack

    return len(decoder_stack(model)[0].layers)


def hf_activations(model: Any, prompt: list[int]) -> dict[str, Any]:
    """One HF forward with hooks: checkpoint name -> float32 tensor [T, ...] (batch dim dropped),
    in execution order: ``embed_tokens``, per layer every direct child module as it runs
    (``layers.{i}.{child}``; Llama's four, Gemma's six norms and blocks, ...) and the layer's
    output ``layers.{i}``, then ``norm``, then ``logits``. A child whose output is not a
    per-token tensor is skipped. The hooks sit on the decoder stack wherever the class keeps
    it (``model.model`` or a wrapper's ``model.model.language_model``)."""
    import torch

    from resin.scaffold.hf_model import decoder_stack

    acts: dict[str, Any] = {}
    handles = []
    num_tokens = len(prompt)

    def hook(name: str) -> Callable[..., None]:
        def fn(_module: Any, _inputs: Any, output: Any) -> None:
            out = output[0] if isinstance(output, (tuple, list)) and output else output
            if (
                not isinstance(out, torch.Tensor)
                or not out.is_floating_point()
                or out.numel() % num_tokens
                or (out.dim() > 1 and out.shape[1] != num_tokens and out.shape[0] != num_tokens)
            ):
                return
            acts[name] = out.detach().to(torch.float32).reshape(num_tokens, -1)

        return fn

    from resin.scaffold.hf_model import stack_part

    inner, _ = decoder_stack(model)
    handles.append(stack_part(inner, "embed_tokens").register_forward_hook(hook("embed_tokens")))
    for i, layer in enumerate(inner.layers):
        for child, module in layer.named_children():
            name = CHILD_ALIASES.get(child, child)
            handles.append(module.register_forward_hook(hook(f"layers.{i}.{name}")))
        handles.append(layer.register_forward_hook(hook(f"layers.{i}")))
    final = stack_part(inner, "norm")  # Phi's final_layernorm, GPT-NeoX's final_layer_norm too
    if final is not None:
        handles.append(final.register_forward_hook(hook("norm")))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0]
    finally:
        for h in handles:
            h.remove()
    acts["logits"] = logits.to(torch.float32)
    return acts


def _split_name(name: str) -> tuple[int | None, str]:
    parts = name.split(".")
    if parts[0] == "layers":
        return int(parts[1]), (".".join(parts[2:]) if len(parts) > 2 else "output")
    return None, name


def scaled_error(got: Any, ref: Any) -> tuple[float, float, float]:
    """(max abs diff, max abs ref, scaled = diff / max(1, ref)); inf on shape mismatch/NaN."""
    ref_max = float(ref.abs().max()) if ref.numel() else 0.0
    if tuple(got.shape) != tuple(ref.shape):
        return math.inf, ref_max, math.inf
    diff = float((got.to(ref.dtype) - ref).abs().max()) if ref.numel() else 0.0
    if math.isnan(diff):
        diff = math.inf
    return diff, ref_max, diff / max(1.0, ref_max)


def as_float_tensor(value: Any) -> Any:
    """A runner's capture (a torch tensor, or a numpy array from a runner without torch, the
    MLX runner's) as a float32 CPU torch tensor."""
    import torch

    return torch.as_tensor(value).detach().float().cpu()


def compare_layers(
    hf: dict[str, Any], runner: dict[str, Any], num_layers: int, tol: Tolerances
) -> tuple[list[dict[str, Any]], StageResult]:
    """Per-checkpoint diffs in the reference's execution order (``hf``'s order), and the
    ``layers`` stage naming the first departure. Checkpoints the runner did not capture are
    listed in ``metrics["missing"]``."""
    rows: list[dict[str, Any]] = []
    missing: list[str] = []
    for name in (n for n in hf if n != "logits"):
        layer, module = _split_name(name)
        if name not in runner:
            missing.append(name)
            continue
        got = as_float_tensor(runner[name])
        got = got.reshape(hf[name].shape) if got.numel() == hf[name].numel() else got
        diff, ref_max, scaled = scaled_error(got, hf[name])
        rows.append(
            {
                "name": name,
                "layer": layer,
                "module": module,
                "max_abs_diff": diff,
                "ref_max_abs": ref_max,
                "scaled_diff": scaled,
                "passed": scaled <= tol.hidden,
            }
        )
    first = next((r for r in rows if not r["passed"]), None)
    worst = max((r["scaled_diff"] for r in rows), default=0.0)
    metrics = {"num_checkpoints": len(rows), "max_scaled_diff": worst, "missing": missing}
    if first is not None:
        where = (
            f"layer {first['layer']} {first['module']}"
            if first["layer"] is not None
            else first["module"]
        )
        return rows, StageResult(
            "layers",
            False,
            f"first departure at {where} (scaled diff {first['scaled_diff']:.3g} > {tol.hidden:g})",
            {k: first[k] for k in ("name", "layer", "module", "max_abs_diff", "scaled_diff")},
            metrics,
        )
    if not rows:
        return rows, StageResult("layers", False, "runner captured no checkpoint", None, metrics)
    detail = f"{len(rows)} checkpoints within {tol.hidden:g} (max scaled diff {worst:.3g})"
    if missing:
        detail += f"; not captured by the runner: {', '.join(missing[:4])}" + (
            "..." if len(missing) > 4 else ""
        )
    return rows, StageResult("layers", True, detail, None, metrics)


def compare_logits(
    hf_logits: Any,
    runner_logits: Any | None,
    engine_logprobs: dict[int, float] | None,
    sampled: int | None,
    tol: Tolerances,
) -> StageResult:
    """Logits / top-k log-probs at every position, and the engine's own top-k log-probs."""
    import torch

    metrics: dict[str, Any] = {}
    problems: list[tuple[str, dict[str, Any]]] = []
    hf_lp = torch.log_softmax(hf_logits, dim=-1)
    engine_by_logits = 0.0  # what the runner's own logits explain of the engine's log-probs
    if runner_logits is not None:
        got = as_float_tensor(runner_logits)
        got = got.reshape(hf_logits.shape) if got.numel() == hf_logits.numel() else got
        diff, ref_max, scaled = scaled_error(got, hf_logits)
        metrics.update(max_abs_diff=diff, scaled_diff=scaled, num_positions=hf_logits.shape[0])
        if math.isfinite(scaled):
            got_lp = torch.log_softmax(got, dim=-1)
            top_ids = hf_lp.topk(TOP_K, dim=-1).indices
            lp_diff = (got_lp.gather(1, top_ids) - hf_lp.gather(1, top_ids)).abs()
            top2 = hf_logits.topk(2, dim=-1).values
            magnitude = hf_logits.abs().amax(-1)
            spacing = tol.unresolved(magnitude)
            near_tie = (top2[:, 0] - top2[:, 1]) < spacing.clamp(min=tol.tie_margin)
            agree = (got.argmax(-1) == hf_logits.argmax(-1)) | near_tie
            metrics.update(
                topk_logprob_max_diff=float(lp_diff.max()),
                top1_agreement=float(agree.float().mean()),
            )
            abs_pos = (got - hf_logits).abs().amax(-1)
            per_pos = abs_pos / max(1.0, ref_max)
            # float32: a log-prob is a logit less the log-sum-exp, off by up to twice its
            # position's largest logit difference; as much of that as the logits' limit allows
            # at this position's own magnitude is the logits' to judge, the rest the log-probs'
            # (a wrong normaliser, another row's values, a logit far off at small logits). In
            # bf16 / fp16 the dtype's spacing floor already follows the magnitude, and their
            # logits limit is loose: no allowance there.
            by_logits = 2 * torch.minimum(abs_pos, tol.logits * magnitude.clamp(min=1.0))
            by_logits = by_logits * (tol.resolution == 0)
            lp_limit = spacing.clamp(min=tol.logprobs) + by_logits
            engine_by_logits = float(by_logits[-1])  # the engine's log-probs: the last position
            bad = (per_pos > tol.logits) | (lp_diff.amax(-1) > lp_limit) | ~agree
            if bool(bad.any()):
                pos = int(bad.nonzero()[0])
                problems.append(
                    (
                        "logits",
                        {
                            "position": pos,
                            "expected": int(hf_logits[pos].argmax()),
                            "got": int(got[pos].argmax()),
                            "scaled_diff": float(per_pos[pos]),
                        },
                    )
                )
        else:
            problems.append(
                (
                    "logits",
                    {
                        "position": None,
                        "shape": list(got.shape),
                        "expected_shape": list(hf_logits.shape),
                    },
                )
            )
    else:
        metrics["note"] = (
            "runner did not capture logits; only the engine's last position is checked"
        )
    if engine_logprobs is not None:
        last = hf_lp[-1]
        worst = max((abs(lp - float(last[t])) for t, lp in engine_logprobs.items()), default=0.0)
        metrics["engine_topk_logprob_max_diff"] = worst
        expected = int(last.argmax())
        top2 = hf_logits[-1].topk(2).values
        magnitude = float(hf_logits[-1].abs().max())
        tie = float(top2[0] - top2[1]) < tol.tie_limit(magnitude)
        limit = tol.logprob_limit(magnitude) + engine_by_logits
        if (sampled != expected and not tie) or worst > limit or math.isnan(worst):
            problems.append(
                (
                    "engine_logprobs",
                    {
                        "position": hf_logits.shape[0] - 1,
                        "expected": expected,
                        "got": sampled,
                        "logprob_diff": worst,
                    },
                )
            )
    if problems:
        what, first = problems[0]
        return StageResult(
            "logits", False, f"{what} depart at position {first.get('position')}", first, metrics
        )
    return StageResult(
        "logits",
        True,
        f"{metrics.get('num_positions', 1)} positions within "
        f"tolerance (top-1 agreement {metrics.get('top1_agreement', 1.0):.3f})",
        None,
        metrics,
    )


_HF_CACHE: dict[tuple[str, float, str, str], Any] = {}
_REFERENCE_CACHE: dict[tuple[Any, ...], GreedyReference] = {}


def _cached_hf_model(model_dir: Path, dtype: str, attention: str = "eager") -> Any:
    """HF models are read-only here, so one load per checkpoint (path + mtime) per process."""
    stamp = max(f.stat().st_mtime for f in model_dir.iterdir())
    key = (str(model_dir.resolve()), stamp, dtype, attention)
    if key not in _HF_CACHE:
        _HF_CACHE.clear()
        _REFERENCE_CACHE.clear()
        extra = {} if attention == "eager" else {"attention": attention}
        _HF_CACHE[key] = load_hf_model(model_dir, dtype, **extra)
    return _HF_CACHE[key]


def _reference_model(model_dir: Path, dtype: str, attention: str) -> tuple[Any, str]:
    """(the HF reference, its attention): with ``attention``, or with ``eager`` where HF's model
    cannot load with it (no sdpa for its attention); one model held at a time
    (:func:`_cached_hf_model`)."""
    if attention != "eager":
        try:
            return _cached_hf_model(model_dir, dtype, attention), attention
        except Exception:  # noqa: BLE001 - no such implementation for this model: eager
            pass
    return _cached_hf_model(model_dir, dtype), "eager"


def run_parity(
    model_dir: str | Path,
    runner_factory: Callable[[str], Any] | None = None,
    prompts: Sequence[str | Sequence[int]] | None = None,
    tolerances: Tolerances | None = None,
    max_new_tokens: int = 8,
    runner_name: str = "torch",
    dtype: str = "float32",
    checks: Sequence[str] = CHECKS,
    greedy_reference: str = "cached",
    hf_attention: str = "auto",
) -> ParityReport:
    """Run the selected ``checks`` (``layers`` includes ``logits``; ``greedy`` = every stress
    stage) and return the report. ``dtype`` is the runner's: the HF reference runs in it and
    the default tolerances follow it (``Tolerances.for_dtype``). Never raises for a parity
    failure: a stage that crashes is reported failed with the exception. Nor when the HF
    reference itself fails: a load that raises gives one failed ``reference`` stage; a forward
    that raises fails ``layers`` and ``logits`` (``reference crashed: ...``); a greedy loop that
    raises fails every ``greedy/*`` stage; ``reference_error`` holds the first reason. Only
    building the runner (``runner_factory``) may raise.

    ``greedy_reference``: ``cached`` (HF's incremental decode) or ``full_forward`` (a no-cache
    forward per step: the model's definition). With ``full_forward`` the harness also checks
    HF's cached decode against it and records any departure in ``reference_findings``.

    ``hf_attention``: HF's attention implementation for the reference, ``auto`` (the one the
    runner's attention computes like: :func:`hf_attention_for`), ``eager`` or ``sdpa``; where
    HF's model has no ``sdpa``, ``eager`` (``report.hf_attention`` says which ran)."""
    import torch

    model_dir = Path(model_dir)
    tol = tolerances or Tolerances.for_dtype(dtype)
    factory = runner_factory or (lambda path: default_runner_factory(path, dtype))
    report = ParityReport(str(model_dir), runner_name, dtype, tol)
    torch.manual_seed(0)
    try:
        hf = _cached_hf_model(model_dir, dtype)
    except Exception as exc:  # noqa: BLE001 - the reference failing is reported, not raised
        report.reference_error = f"HF reference failed to load ({dtype}): {exception_text(exc)}"
        report.stages.append(
            StageResult(
                "reference",
                False,
                report.reference_error,
                None,
                {"reference_error": report.reference_error},
            )
        )
        return report
    vocab_size = hf_vocab_size(hf)
    token_prompts = _encode_prompts(model_dir, prompts) if prompts else default_prompts(vocab_size)
    runner = factory(str(model_dir))  # (after the reference loads: never for an unusable one)
    limit = length_limit(runner)
    if limit is not None:
        token_prompts, note = fit_prompts(token_prompts, max_new_tokens, limit, bool(prompts))
        report.prompt_notes += [note] if note else []
    attention = hf_attention_for(runner, hf_attention)
    if attention != "eager":
        hf = None  # one HF model held at a time: the cache drops the eager one before loading
        hf, report.hf_attention = _reference_model(model_dir, dtype, attention)
    try:
        report.reference_adjustments = adjust_reference(runner, hf)
    except Exception as exc:  # noqa: BLE001 - the reference failing is reported, not raised
        report.reference_error = f"the model's reference.py failed: {exception_text(exc)}"
        report.stages.append(StageResult("reference", False, report.reference_error))
        return report

    hf_acts: dict[str, Any] | None = None
    probe = max(token_prompts, key=len)
    if "layers" in checks:
        try:
            hf_acts = hf_activations(hf, probe)
        except Exception as exc:  # noqa: BLE001 - HF's own forward raised: nothing to compare
            report.reference_error = (
                f"{REFERENCE_CRASHED}: HF forward ({dtype}) raised {exception_text(exc)}"
            )
            report.stages.extend(
                reference_failed_stages(("layers", "logits"), report.reference_error)
            )
    if hf_acts is not None:
        try:
            acts, engine_lp, sampled = runner_capture_prefill(runner, probe, vocab_size, TOP_K)
            if acts is None:
                report.stages.append(StageResult("layers", False, "runner has no capture hook"))
            else:
                report.layers, stage = compare_layers(hf_acts, acts, hf_num_layers(hf), tol)
                report.stages.append(stage)
            report.stages.append(
                compare_logits(
                    hf_acts["logits"], (acts or {}).get("logits"), engine_lp, sampled, tol
                )
            )
        except Exception as exc:  # noqa: BLE001 - a crash is a finding, reported like one
            detail = crash_detail(exc)
            report.stages.append(StageResult("layers", False, f"prefill crashed: {detail}"))
    if "greedy" in checks:
        key = (id(hf), tuple(map(tuple, token_prompts)), max_new_tokens, greedy_reference)

        def compute() -> GreedyReference:
            if key not in _REFERENCE_CACHE:
                _REFERENCE_CACHE.clear()
                _REFERENCE_CACHE[key] = GreedyReference.compute(
                    hf, token_prompts, max_new_tokens, greedy_reference
                )
            return _REFERENCE_CACHE[key]

        reference, stages = greedy_stages_or_reference_failure(
            runner, compute, vocab_size, tol.tie_margin
        )
        if reference is None and report.reference_error is None:
            report.reference_error = stages[0].detail
        report.stages.extend(stages)
        if reference is not None and greedy_reference == "full_forward":
            try:
                finding, metrics = cached_vs_full_forward(hf, reference, tol.tie_margin)
            except Exception as exc:  # noqa: BLE001 - HF's cached path failing is a finding
                finding, metrics = f"HF's cached decode raised {exception_text(exc)}", {}
            report.reference_findings.append(
                {
                    "finding": finding
                    or "HF's cached decode agrees with its full forward "
                    f"({metrics.get('argmax_disagreements', 0)} near-tie disagreement(s), max "
                    f"|logit diff| {metrics.get('max_abs_logit_diff', 0.0):.3g})",
                    "departs": finding is not None,
                    **metrics,
                }
            )
    return report
