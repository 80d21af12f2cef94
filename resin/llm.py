"""The offline API: ``LLM(model_dir).generate(prompts, params)`` and ``LLM.chat(messages)``.

``LLM`` loads one Hugging Face checkpoint directory — ``config.json``
(:func:`resin.loading.checkpoint_info.read_checkpoint_info`), the tokenizer
(:class:`resin.tokenizer.Tokenizer`), the chat template (:class:`resin.chat_template.ChatTemplate`)
and a runner (the one the model registry, :mod:`resin.registry`, picks for the checkpoint's
architecture, unless ``runner=`` names or passes one) — and drives a :class:`resin.Engine` over
it. ``generate`` adds
every prompt as a request, steps the engine until all are finished and returns one
:class:`LLMOutput` per prompt, in prompt order, like vLLM's ``LLM.generate``.

Engine defaults (each can be overridden with a keyword of :class:`resin.EngineConfig`):

- ``max_model_len``: the checkpoint's ``max_position_embeddings``, capped at
  :data:`DEFAULT_MAX_MODEL_LEN` so a 128k-context config does not size the cache for 128k,
  and at the runner's ``max_model_len_limit`` (a model directory's longest length computed as
  transformers does, e.g. Phi-3 longrope's original length, or a ``dynamic`` rope's
  ``max_position_embeddings``; a longer one is refused).
- ``num_pages``: enough pages for ``max_num_seqs`` sequences of ``max_model_len`` tokens (the
  engine's own rule, ``CacheLayout.pages_per_request``: every cache group, recurrent states
  and their checkpoints in flight included), but no more than fit in ``kv_cache_bytes``
  (default :data:`DEFAULT_KV_CACHE_BYTES`), counting a page id as one page of every shared
  layer slot plus one of each compressed layer (:func:`page_id_bytes`); and never fewer than
  one full-length sequence needs. Plus one for the null page.
- ``eos_token_ids``: the tokenizer's EOS plus ``generation_config.json``'s (vLLM's rule);
  ``vocab_size``: ``config.json``'s.
- ``cuda_graph_batch_sizes``: the decode batch sizes the runner captures CUDA graphs at, as
  its ``configure_cuda_graphs`` chooses them (``cuda_graph_batch_sizes=None``: vLLM's default
  sizes up to ``max_num_seqs``); empty — no padding, every step eager — with
  ``enforce_eager=True``, on CPU, or for a runner that cannot capture
  (:mod:`resin.runners.torch.cuda_graphs` says why in the ``resin.cuda_graphs`` log).

Sampling: with no ``sampling_params`` the request defaults are ``SamplingParams()`` updated with
the checkpoint's ``generation_config.json`` fields (``Tokenizer.sampling_defaults``), as vLLM does.
``text`` is decoded with ``skip_special_tokens=True`` and leaves out the stop token that ended
the request (``token_ids`` keep it), as vLLM does.

Importing this module does not import torch; building the default runner does.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resin._core import CacheLayout, Engine, EngineConfig, RequestOutput, SamplingParams
from resin.chat_template import ChatTemplate
from resin.loading.checkpoint_info import CheckpointInfo, read_checkpoint_info
from resin.loading.fields import ConfigError
from resin.loading.rope import RopeConfig, check_rope_length
from resin.tokenizer import Tokenizer

DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_KV_CACHE_BYTES = 2 << 30  # 2 GiB of KV cache unless the caller says otherwise
DEFAULT_MAX_NUM_SEQS = 64
# Speculative decoding: "ngram" (the engine's prompt-lookup drafter) or "mtp" (the
# checkpoint's next-n layer, drafted by the runner: resin.runners.torch.mtp_drafter).
SPECULATIVE_METHODS = ("ngram", "mtp")
DEFAULT_NUM_SPECULATIVE_TOKENS = 3
MAX_IDLE_STEPS = 10_000  # consecutive steps without any output before generate gives up

Prompt = str | list[int]
log = logging.getLogger("resin.cuda_graphs")


@dataclass
class LLMOutput:
    """One finished request. ``prompt`` is the text prompt (None for a token-id prompt);
    ``token_ids`` are all generated tokens (a final stop token included); ``logprobs`` is one
    ``{token_id: logprob}`` dict per generated token when requested, else None;
    ``prompt_logprobs`` (``SamplingParams.prompt_logprobs``) None for the first prompt token,
    then one such dict per prompt token, when requested, else None. The fields of the
    engine's :class:`resin.RequestOutput` that a finished request keeps, as plain values."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[dict[int, float]] | None
    prompt_logprobs: list[dict[int, float] | None] | None = None


class LLM:
    """A checkpoint, its tokenizer and chat template, a runner and an engine, for offline use.

    ``runner``: None (the registry's runner for the checkpoint), a runner name or spec as
    ``--runner`` takes (``torch``, ``mlx`` — the MLX runner, ``device`` ``cpu`` or ``gpu`` —,
    ``null``, a registered model, a model directory, ``module:Class``), or any
    :class:`resin.Runner` object. ``models_dirs``: extra model
    directories to register (as ``--models-dir``). ``attention_backend``: the torch runners'
    attention backend (``reference`` by default). ``dtype``: a torch dtype or its name
    (``"float32"``, ``"bfloat16"``, ``"float16"``). ``speculative_method``: None (off),
    ``"ngram"`` or ``"mtp"`` (the runner's ``enable_mtp``; ValueError when the checkpoint has no
    MTP layer), drafting ``num_speculative_tokens`` (default 3) per step.
    ``tensor_parallel_size`` / ``expert_parallel_size``: N > 1 runs a built-in-family
    checkpoint on N ranks (:class:`resin.runners.parallel.TensorParallelRunner`: N - 1 worker
    processes; ``llm.close()`` stops them, as does the process exit) — attention and MLPs
    split (TP), the routed experts dealt out (EP), or both over the same ranks.
    ``data_parallel_size``: D attention replicas, each with its own engine and requests, the
    MoE layers shared (:class:`resin.runners.parallel.data_parallel.DataParallelEngine`).
    ``context_parallel_size``: long prefills' rows split over N ranks
    (:mod:`resin.runners.parallel.context_parallel`; full and sliding-window attention).
    ``enforce_eager``: no CUDA graphs (no capture, no padding). ``cuda_graph_batch_sizes``: the
    decode batch sizes to capture (None: the runner's defaults up to ``max_num_seqs``); they
    reach the engine as ``EngineConfig.cuda_graph_batch_sizes`` when the runner captures them
    (a CUDA torch runner on a graph-safe backend, e.g. ``attention_backend="triton"``).
    ``engine_config``: :class:`resin.EngineConfig` fields.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        runner: Any = None,
        device: str = "cpu",
        dtype: Any = "float32",
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        models_dirs: Sequence[str | Path] = (),
        attention_backend: str | None = None,
        speculative_method: str | None = None,
        tensor_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        data_parallel_size: int = 1,
        context_parallel_size: int = 1,
        enforce_eager: bool = False,
        cuda_graph_batch_sizes: Sequence[int] | None = None,
        **engine_config: Any,
    ) -> None:
        from resin.registry import ModelRegistry, resolve_runner

        if speculative_method not in (None, *SPECULATIVE_METHODS):
            raise ValueError(
                f"speculative method {speculative_method!r}; known: "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        if speculative_method is not None:
            engine_config.setdefault("num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS)

        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"model directory {self.model_dir} does not exist")
        self.model_config: CheckpointInfo = read_checkpoint_info(self.model_dir)
        self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
        self.chat_template = ChatTemplate.from_pretrained(
            self.model_dir, self.tokenizer.special_tokens_map
        )
        registry = ModelRegistry(models_dirs)
        if context_parallel_size > 1:
            if max(tensor_parallel_size, expert_parallel_size, data_parallel_size) > 1:
                raise ValueError("context_parallel_size runs alone (no TP / EP / DP with it)")
            self.runner = _parallel_runner(
                self.model_dir, runner, registry, 1, 1, device, dtype, attention_backend,
                context_parallel=context_parallel_size,
            )  # fmt: skip
        elif data_parallel_size > 1:
            if tensor_parallel_size > 1 or expert_parallel_size not in (1, data_parallel_size):
                raise ValueError(
                    "data_parallel_size: DP attention with the experts dealt over the same "
                    "ranks (expert_parallel_size 1 or equal), no tensor parallelism"
                )
            self.runner = _parallel_runner(
                self.model_dir, runner, registry, 1, data_parallel_size, device, dtype,
                attention_backend, data_parallel=True,
            )  # fmt: skip
        elif tensor_parallel_size > 1 or expert_parallel_size > 1:
            self.runner = _parallel_runner(
                self.model_dir, runner, registry, tensor_parallel_size, expert_parallel_size,
                device, dtype, attention_backend,
            )  # fmt: skip
        else:
            self.runner = resolve_runner(
                self.model_dir,
                runner,
                registry=registry,
                device=device,
                dtype=dtype,
                attention_backend=attention_backend,
            )
        if speculative_method == "mtp":
            enable_mtp = getattr(self.runner, "enable_mtp", None)
            if enable_mtp is None:
                raise ValueError(
                    f"runner {type(self.runner).__name__} has no MTP drafter (enable_mtp)"
                )
            enable_mtp(int(engine_config["num_speculative_tokens"]))
        config = self._engine_config(self.runner, kv_cache_bytes, engine_config)
        config.cuda_graph_batch_sizes = cuda_graph_sizes(
            self.runner, config, cuda_graph_batch_sizes, enforce_eager
        )
        # An Engine, or (DP attention) D of them behind the part of its interface used here.
        self.engine: Engine
        if data_parallel_size > 1:
            from resin.runners.parallel.data_parallel import DataParallelEngine

            self.engine = DataParallelEngine(config, self.runner)  # type: ignore[assignment]
        else:
            self.engine = Engine(config, self.runner)
        if config.async_scheduling and not getattr(self.engine, "async_scheduling", False):
            logging.getLogger(__name__).warning(
                "async_scheduling is off: runner %s has no begin_forward / finish_forward "
                "(docs/runners.md, 'Overlapped scheduling'); every step runs plainly",
                type(self.runner).__name__,
            )
        self._request_counter = itertools.count()

    # -- construction ---------------------------------------------------------------------
    def close(self) -> None:
        """Release what the runner holds outside this process (tensor-parallel workers)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def _engine_config(
        self, runner: Any, kv_cache_bytes: int, overrides: Mapping[str, Any]
    ) -> EngineConfig:
        fields = set(dir(EngineConfig)) - set(dir(object))
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {unknown}; EngineConfig fields are "
                f"{sorted(f for f in fields if not f.startswith('_'))}"
            )
        settings: dict[str, Any] = dict(overrides)
        default_len = min(self.model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        limit = getattr(runner, "max_model_len_limit", None)  # a model directory's own
        if limit is not None:
            longest, why = limit
            if settings.get("max_model_len", longest) > longest:
                raise ConfigError(
                    f"max_model_len {settings['max_model_len']} is past {longest}: {why}. "
                    f"Serve with max_model_len <= {longest}"
                )
            default_len = min(default_len, longest)
        settings.setdefault("max_model_len", default_len)
        rope = getattr(getattr(runner, "config", None), "rope", None)  # a built-in family's
        if isinstance(rope, RopeConfig):
            check_rope_length(rope, int(settings["max_model_len"]))
        settings.setdefault("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
        settings.setdefault("page_size", 16)
        settings.setdefault(
            "max_num_batched_tokens", max(2048, min(settings["max_model_len"], 8192))
        )
        settings.setdefault("eos_token_ids", self.tokenizer.eos_token_ids)
        settings.setdefault("vocab_size", self.model_config.vocab_size)
        settings.setdefault("enable_prefix_caching", True)
        if "num_pages" not in settings:
            # A runner without cache_spec (scripted, null) stores nothing: one full group of
            # no bytes, sized so the pool still holds full-length sequences.
            specs = runner.cache_spec() if hasattr(runner, "cache_spec") else []
            layout = CacheLayout.from_specs(list(specs), settings["page_size"])
            settings["num_pages"] = default_num_pages(
                layout.pages_per_request(
                    settings["max_model_len"],
                    settings["max_num_batched_tokens"],
                    settings["enable_prefix_caching"],
                    settings.get("num_speculative_tokens", 0),
                ),
                page_id_bytes(layout),
                settings["max_num_seqs"],
                kv_cache_bytes,
            )
        return EngineConfig(**settings)

    # -- generation -------------------------------------------------------------------------
    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the checkpoint's generation-config defaults applied."""
        defaults: dict[str, Any] = dict(self.tokenizer.sampling_defaults)
        return SamplingParams(**defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[LLMOutput]:
        """Generate for one prompt or a batch (strings and/or token-id lists), in one engine
        batch; outputs come back in prompt order. ``sampling_params``: one for all, or one per
        prompt."""
        batch = _as_prompt_list(prompts)
        encoded: list[tuple[str | None, list[int]]] = []
        for prompt in batch:
            if isinstance(prompt, str):
                encoded.append((prompt, self.tokenizer.encode(prompt)))
            else:
                encoded.append((None, [int(t) for t in prompt]))
        return self._run(encoded, sampling_params)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        **chat_template_kwargs: Any,
    ) -> list[LLMOutput]:
        """Render one conversation (a list of messages) or several (a list of lists) with the
        chat template (``add_generation_prompt=True``; extra kwargs such as ``tools`` or
        ``enable_thinking`` go to the template), then generate. The rendered text is tokenized
        without adding special tokens: the template supplies them (vLLM's choice)."""
        if not messages:
            raise ValueError("chat() needs at least one message")
        conversations: list[Any] = (
            [messages] if isinstance(messages[0], Mapping) else list(messages)
        )
        chat_template_kwargs.setdefault("add_generation_prompt", True)
        encoded: list[tuple[str | None, list[int]]] = []
        for conversation in conversations:
            text = self.chat_template.render(conversation, **chat_template_kwargs)
            encoded.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(encoded, sampling_params)

    def _run(
        self,
        encoded: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[LLMOutput]:
        if sampling_params is None:
            params_list = [self.default_sampling_params()] * len(encoded)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(encoded)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(encoded):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(encoded)} "
                    "prompts; pass one, or one per prompt"
                )
        ids = [str(next(self._request_counter)) for _ in encoded]
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        added: list[str] = []
        try:
            for request_id, (_, token_ids), params in zip(ids, encoded, params_list):
                if not token_ids:
                    raise ValueError("prompt is empty: it has no tokens")
                self.engine.add_request(request_id, token_ids, params)
                added.append(request_id)
            idle = 0
            while len(finished) < len(ids):
                if not self.engine.has_unfinished():
                    missing = sorted(set(ids) - set(finished))
                    raise RuntimeError(f"engine stopped without finishing requests {missing}")
                outputs = self.engine.step()
                idle = 0 if outputs else idle + 1
                if idle > MAX_IDLE_STEPS:
                    raise RuntimeError(
                        f"engine made no progress in {MAX_IDLE_STEPS} steps "
                        f"({self.engine.num_waiting} waiting, "
                        f"{self.engine.num_running} running)"
                    )
                for output in outputs:
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
        except BaseException:
            for request_id in added:
                if request_id not in finished:
                    self.engine.abort(request_id)
            if self.engine.has_unfinished():  # drain the abort notices
                self.engine.step()
            raise
        return [
            self._to_output(finished[request_id], prompt)
            for request_id, (prompt, _) in zip(ids, encoded)
        ]

    def _to_output(self, output: RequestOutput, prompt: str | None) -> LLMOutput:
        token_ids = list(output.token_ids)
        text_ids = token_ids[:-1] if output.finish_reason == "stop" and token_ids else token_ids
        logprobs = output.logprobs
        return LLMOutput(
            request_id=output.request_id,
            prompt=prompt,
            prompt_token_ids=list(output.prompt_token_ids),
            token_ids=token_ids,
            text=self.tokenizer.decode(text_ids, skip_special_tokens=True),
            finish_reason=output.finish_reason,
            num_cached_tokens=output.num_cached_tokens,
            logprobs=None
            if logprobs is None
            else [{int(k): float(v) for k, v in entry.items()} for entry in logprobs],
            prompt_logprobs=output.prompt_logprobs,
        )


def cuda_graph_sizes(
    runner: Any, config: EngineConfig, requested: Sequence[int] | None, enforce_eager: bool
) -> list[int]:
    """The batch sizes ``runner`` captures CUDA graphs at (its ``configure_cuda_graphs``, told
    the engine's ``max_num_seqs`` and ``max_model_len``), for ``EngineConfig.cuda_graph_batch_sizes``;
    [] with ``enforce_eager`` or a runner without graphs."""
    if enforce_eager:
        return []
    configure = getattr(runner, "configure_cuda_graphs", None)
    if configure is None:
        if requested:
            log.info("CUDA graphs off: runner %s does not capture them", type(runner).__name__)
        return []
    sizes = configure(
        requested, max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len
    )
    return [int(b) for b in sizes]


def parse_batch_sizes(text: str | None) -> list[int] | None:
    """``--cuda-graph-batch-sizes``: sizes separated by commas or spaces (``"1,2,4,8"``); None
    for None (the runner's defaults). ValueError for anything but positive integers."""
    if text is None:
        return None
    parts = text.replace(",", " ").split()
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(
            f"--cuda-graph-batch-sizes {text!r}: positive integers separated by commas, "
            "e.g. 1,2,4,8"
        )
    return sorted({int(p) for p in parts})


def default_num_pages(
    pages_per_request: int, page_id_bytes: int, max_num_seqs: int, kv_cache_bytes: int
) -> int:
    """Pages for the cache pool: ``max_num_seqs`` requests of ``pages_per_request`` pages each
    (one request at ``max_model_len``, :meth:`CacheLayout.pages_per_request`) if that fits in
    ``kv_cache_bytes`` at ``page_id_bytes`` per page id, else as many as fit, but at least one
    full-length request; plus the null page."""
    fit = kv_cache_bytes // max(1, page_id_bytes)
    return 1 + max(pages_per_request, min(pages_per_request * max_num_seqs, fit))


def page_id_bytes(layout: CacheLayout) -> int:
    """Bytes one page id costs in the torch runners' buffers: one page of ``page_bytes`` in
    each shared layer slot (``num_layer_slots``: token and recurrent groups share them), plus
    a page in each compressed layer's own buffer (``CacheGroup.page_bytes``); a runner with
    no shared slots (no token layer) keeps each recurrent state in its own buffer."""
    total = layout.num_layer_slots * layout.page_bytes
    for group in layout.groups:
        if group.spec.kind == "compressed":
            total += group.page_bytes * len(group.layer_indices)
        elif group.pages_per_state and not layout.page_bytes:
            total += (group.spec.state_bytes or 0) * len(group.layer_indices)
    return total


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise TypeError(
            f"prompts must be a str, a list of token ids, or a list of those; "
            f"got {type(prompts).__name__}"
        )
    items: list[Any] = list(prompts)
    if items and all(isinstance(p, int) and not isinstance(p, bool) for p in items):
        return [list(items)]  # one token-id prompt
    for prompt in items:
        if not isinstance(prompt, (str, list, tuple)) or (
            not isinstance(prompt, str)
            and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            raise TypeError(f"each prompt must be a str or a list of token ids, got {prompt!r}")
    return [p if isinstance(p, str) else list(p) for p in items]


def _parallel_runner(
    model_dir: Path,
    runner: Any,
    registry: Any,
    tp: int,
    ep: int,
    device: str,
    dtype: Any,
    attention_backend: str | None,
    data_parallel: bool = False,
    context_parallel: int = 1,
) -> Any:
    """The parallel runner of a built-in-family checkpoint: TP over ``tp`` ranks, EP over
    ``ep`` (alone, or over the same ranks as TP); model directories, MLX and explicit runner
    objects are refused with the reason."""
    if runner not in (None, "torch"):
        raise ValueError(
            f"tensor / expert parallelism runs the built-in torch runner; runner {runner!r} "
            "cannot be sharded"
        )
    if tp > 1 and ep > 1 and tp != ep:
        raise ValueError(
            f"expert_parallel_size {ep} with tensor_parallel_size {tp}: experts are dealt "
            "over the tensor-parallel ranks (equal sizes), or EP runs alone (tp 1)"
        )
    entry = registry.for_checkpoint(model_dir)  # a model directory shards by its own rules
    from resin.runners.parallel import TensorParallelRunner

    if context_parallel > 1:
        return TensorParallelRunner(
            model_dir,
            context_parallel,
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
            tensor_parallel=False,
            context_parallel=True,
            model_directory=entry.model_dir,
        )
    return TensorParallelRunner(
        model_dir,
        max(tp, ep),
        device=device,
        dtype=dtype,
        attention_backend=attention_backend,
        tensor_parallel=tp > 1,
        expert_parallel=ep > 1,
        data_parallel=data_parallel,
        model_directory=entry.model_dir,
    )
