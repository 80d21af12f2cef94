"""Type stubs for ``resin._core``, the PyO3 bindings of the Rust engine core.

Checked against the compiled module by ``python -m mypy.stubtest resin._core``
(see ``tests/test_stubs.py``). Every array is a host numpy array, C-contiguous and
read-only; dtype and shape are given in each docstring. ``S`` = sequences in the
plan, ``T`` = new tokens in the plan, ``N`` = tokens returned by the runner.
The field list agrees with ``docs/batch_plan.md`` and the Rust doc comments in
``rust/core/src/plan.rs``.
"""

from typing import Any, Final, Literal, Protocol, final

import numpy as np
import numpy.typing as npt

__version__: Final[str]
__all__ = [
    "BatchPlan",
    "CacheGroup",
    "CacheLayout",
    "Engine",
    "EngineConfig",
    "ForwardOutput",
    "InvalidOutputError",
    "LayerCacheSpec",
    "RequestOutput",
    "SamplingArrays",
    "SamplingParams",
    "StepError",
    "kernels_vectorised",
    "linear",
    "openmp_team_available",
    "paged_attention",
    "rotary_embedding",
    "rms_norm",
    "nucleus_cut",
    "top_candidates",
    "argmax",
    "inverse_cdf",
    "softmax",
    "sample_rows",
    "__version__",
]

_FinishReason = Literal["stop", "length", "abort"]

class _RunnerLike(Protocol):
    def forward(self, plan: BatchPlan, /) -> ForwardOutput: ...

@final
class SamplingParams:
    """Per-request generation parameters; validated on construction (``ValueError`` names the field).

    ``top_k`` 0 or -1 disables top-k (stored as 0). ``seed`` None = non-deterministic.
    ``logprobs`` None = none; 0 = the sampled token's logprob only; k = also the top k.
    ``prompt_logprobs`` the same for each prompt token after the first (vLLM's): its logprob
    given the tokens before it; such a request takes no prefix-cache hit until they are
    computed. ``priority``: lower value is served first under ``policy="priority"``.
    ``logit_bias``: token id -> bias in [-100, 100] added to that token's logit before the
    penalties (OpenAI's ``logit_bias``); each token below ``EngineConfig.vocab_size``.
    ``speculate``: False keeps speculative decoding from drafting for the request (plain
    decode rows; the server sets it for grammar-constrained requests, whose drafts the sampler
    cannot mask).
    """

    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: dict[int, float]
    priority: int
    speculate: bool
    def __new__(
        cls,
        max_tokens: int = 16,
        min_tokens: int = 0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        priority: int = 0,
        logit_bias: dict[int, float] | None = None,
        prompt_logprobs: int | None = None,
        speculate: bool = True,
    ) -> SamplingParams: ...

@final
class LayerCacheSpec:
    """What one layer keeps in the cache. Layers with equal specs form cache groups (token /
    recurrent ones of CacheLayout.num_layer_slots layers each)."""

    @property
    def kind(self) -> Literal["full", "sliding_window", "recurrent", "compressed"]: ...
    @property
    def bytes_per_token(self) -> int:
        """Bytes per token of a full / sliding-window layer; 0 for recurrent and compressed."""
    @property
    def window(self) -> int | None:
        """Sliding window in tokens: a query at position p attends keys in (p - window, p]."""
    @property
    def ratio(self) -> int | None:
        """Compressed layers: source tokens per entry (entry e covers tokens
        [e*ratio, (e+1)*ratio)); None otherwise."""
    @property
    def bytes_per_entry(self) -> int | None:
        """Compressed layers: bytes per entry; None otherwise."""
    @property
    def state_bytes(self) -> int | None: ...
    @staticmethod
    def full(bytes_per_token: int) -> LayerCacheSpec: ...
    @staticmethod
    def sliding_window(window: int, bytes_per_token: int) -> LayerCacheSpec: ...
    @staticmethod
    def recurrent(state_bytes: int) -> LayerCacheSpec:
        """A recurrent state of state_bytes per request (per layer), held in
        CacheGroup.pages_per_state pages of CacheLayout.page_bytes each."""
    @staticmethod
    def compressed(ratio: int, bytes_per_entry: int) -> LayerCacheSpec:
        """Compressed attention (DeepSeek-V4 CSA / HCA): one entry of bytes_per_entry per
        ratio source tokens; a page spans lcm(page_size, ratio) source tokens and holds
        CacheGroup.entries_per_page = lcm(page_size, ratio) // ratio entries (page_size //
        ratio when the ratio divides the page size; 1 when the page size divides it). The
        entry a token closes is written via slot_mapping; the carry (the open window's
        tokens, an overlapping window's previous half) is read from a sliding-window group
        of the same layer with window >= (1 + overlap) * ratio."""

@final
class CacheGroup:
    """Layers that share one page table (``kv_indptr[g]`` ... in the plan)."""

    @property
    def spec(self) -> LayerCacheSpec: ...
    @property
    def layer_indices(self) -> list[int]: ...
    @property
    def pages_per_state(self) -> int:
        """Pages one recurrent state occupies: max(1, ceil(state_bytes / page_bytes)), 1 when
        page_bytes is 0; 0 for a token (full / sliding-window) or compressed group."""
    @property
    def entries_per_page(self) -> int:
        """Positions one page holds: page_size for a token (full / sliding-window) group;
        lcm(page_size, ratio) // ratio entries for a compressed group; 0 for a recurrent one.
        A compressed layer's buffer is [num_pages, entries_per_page, ...]."""
    @property
    def page_bytes(self) -> int:
        """Bytes one page of this group holds in one layer's buffer: entries_per_page *
        bytes_per_token (bytes_per_entry); 0 for a recurrent group (CacheLayout.page_bytes)."""

@final
class CacheLayout:
    """Handed to ``runner.bind_cache`` once: how the runner must shape its cache buffers.

    Page ids in plans index ``[0, num_pages)``; page 0 is the null page (never allocated,
    must stay zero). Group ``g`` of the plan is ``groups[g]``.
    """

    @property
    def num_pages(self) -> int: ...
    @property
    def page_size(self) -> int:
        """Tokens per page."""
    @property
    def page_bytes(self) -> int:
        """Bytes one page holds in one layer's buffer of a token group: the largest
        page_size * bytes_per_token over the token layers (0 if none); a compressed group's
        pages have their own size (CacheGroup.page_bytes). A recurrent layer's buffer is num_pages pages of
        page_bytes (of state_bytes when page_bytes is 0); a state spans pages_per_state of
        them, the last one padded."""
    @property
    def num_layer_slots(self) -> int:
        """Layers in the largest token / recurrent group. Same-spec layers are split into
        groups of G layers (G = the smallest such bucket, or the largest when all are within
        1.5x), so a runner can share one buffer of num_pages pages of page_bytes per layer
        slot across groups: the k-th layer of every token / recurrent group views slot k (a
        page id belongs to one group at a time). Compressed groups are not split or counted."""
    @property
    def groups(self) -> list[CacheGroup]: ...
    def group_of_layer(self, layer_index: int) -> int: ...
    @staticmethod
    def from_specs(specs: list[LayerCacheSpec], page_size: int, num_pages: int = 2) -> CacheLayout:
        """The layout an Engine builds for these per-layer specs: for sizing a pool first."""
    def pages_per_request(
        self,
        max_model_len: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        num_speculative_tokens: int = 0,
    ) -> int:
        """Most pages one request of max_model_len tokens holds at once, over all groups
        (states, a checkpoint in flight and, with speculative decoding, a spare state per
        recurrent group included): the pool must hold this many besides the null page."""

@final
class EngineConfig:
    """Engine settings; validated on construction and against the cache layout by ``Engine``."""

    page_size: int
    num_pages: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    eos_token_ids: list[int]
    vocab_size: int | None
    policy: Literal["fcfs", "priority"]
    recurrent_checkpoint_interval: int
    """Recurrent groups with prefix caching: tokens between state checkpoints, rounded up to
    a multiple of page_size (0 = every page boundary; default 256). The page boundary just
    before a prompt's last token is always checkpointed, so a repeated or extended prompt
    hits there; other hits on recurrent groups fall on multiples of the interval."""
    num_speculative_tokens: int
    """Speculative decoding with the n-gram drafter (prompt lookup): up to this many draft
    tokens per decoding request and step, verified in one row of 1 + k tokens
    (num_draft_tokens, 1 + k sampling rows); the engine commits the longest prefix the runner's
    sampled tokens agree with plus the token after it. 0 = off. With recurrent groups each
    request also holds a spare state per group: saved before a verify row (copy_pages),
    restored after a rejection, whose row is then recomputed."""
    ngram_prompt_lookup_min: int
    ngram_prompt_lookup_max: int
    """The drafter looks up the sequence's last max .. min tokens (longest first)."""
    cuda_graph_batch_sizes: list[int]
    """CUDA-graph batch buckets, strictly ascending (default empty: no padding). A pure-decode
    step (every row a one-token decode row: no prefill chunk, no verify row) of S rows reports
    ``BatchPlan.padded_num_sequences`` = the smallest bucket >= S; any other step, or S above
    every bucket, reports S. The plan's arrays stay S rows long: padding rows exist only in the
    runner's static buffers (docs/batch_plan.md, "CUDA-graph padding")."""
    async_scheduling: bool
    """``Engine.step()`` overlaps the runner's next step with the caller's output processing:
    it finishes the step the last call began, commits it, then plans the next one and has the
    runner begin it (``begin_forward``) before returning. Needs a runner with
    ``begin_forward(plan)`` and ``finish_forward()``; otherwise ignored (``Engine.async_scheduling``
    says which). Default False (docs/architecture.md, "Overlapped scheduling")."""
    def __new__(
        cls,
        page_size: int = 16,
        num_pages: int = 4096,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 4096,
        enable_prefix_caching: bool = True,
        eos_token_ids: list[int] | None = None,
        vocab_size: int | None = None,
        policy: Literal["fcfs", "priority"] = "fcfs",
        recurrent_checkpoint_interval: int = 256,
        num_speculative_tokens: int = 0,
        ngram_prompt_lookup_min: int = 1,
        ngram_prompt_lookup_max: int = 4,
        cuda_graph_batch_sizes: list[int] | None = None,
        async_scheduling: bool = False,
    ) -> EngineConfig: ...

@final
class SamplingArrays:
    """Sampling parameters of each plan row (struct of arrays, each shape [S])."""

    @property
    def temperature(self) -> npt.NDArray[np.float32]: ...
    @property
    def top_p(self) -> npt.NDArray[np.float32]: ...
    @property
    def top_k(self) -> npt.NDArray[np.int32]:
        """0 = disabled."""
    @property
    def min_p(self) -> npt.NDArray[np.float32]: ...
    @property
    def seed(self) -> npt.NDArray[np.int64]:
        """-1 = no seed."""
    @property
    def num_logprobs(self) -> npt.NDArray[np.int32]:
        """-1 = no logprobs; 0 = sampled token only; k = sampled token and top k."""
    @property
    def num_prompt_logprobs(self) -> npt.NDArray[np.int32]:
        """-1 = the row has no prompt logprob target; k >= 0: its targets want their
        logprob and the top k."""
    @property
    def presence_penalty(self) -> npt.NDArray[np.float32]: ...
    @property
    def frequency_penalty(self) -> npt.NDArray[np.float32]: ...
    @property
    def repetition_penalty(self) -> npt.NDArray[np.float32]: ...

@final
class BatchPlan:
    """One engine step: everything a runner needs for one forward pass. Immutable.

    Rows are ordered decode rows first (``query_len == 1`` and the row samples), then
    prefill chunks. Arrays are owned by Rust and reach numpy without a copy.
    """

    @property
    def step(self) -> int: ...
    @property
    def num_sequences(self) -> int: ...
    @property
    def num_decode_sequences(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def padded_num_sequences(self) -> int:
        """CUDA-graph bucket of the step: for a pure-decode step with
        ``EngineConfig.cuda_graph_batch_sizes`` set, the smallest bucket >= num_sequences; else
        num_sequences. Every array still has num_sequences rows: a runner replaying a graph at
        this size pads its own static buffers with rows that read and write nothing (one query
        token at position 0, seq_len 1, page list = the null page 0, slot -1, samples
        discarded); any runner may ignore it and run the S rows eagerly."""
    @property
    def page_size(self) -> int: ...
    @property
    def num_cache_groups(self) -> int: ...
    @property
    def request_ids(self) -> list[str]: ...
    @property
    def request_slots(self) -> npt.NDArray[np.uint32]:
        """uint32[S]: stable row in [0, max_num_seqs) for per-request runner state."""
    @property
    def input_ids(self) -> npt.NDArray[np.uint32]:
        """uint32[T]: new tokens, sequences concatenated."""
    @property
    def positions(self) -> npt.NDArray[np.int64]:
        """int64[T]: absolute position of each new token."""
    @property
    def prompt_logprob_targets(self) -> npt.NDArray[np.int64]:
        """int64[T], or empty when no row asks for prompt logprobs: for a token at position p
        of a row whose request asks, prompt token p + 1 (return its logprob given tokens 0..p,
        in token order, in ForwardOutput.prompt_logprobs); -1 for every other token."""
    @property
    def query_indptr(self) -> npt.NDArray[np.uint32]:
        """uint32[S+1]: row i's tokens are input_ids[query_indptr[i]:query_indptr[i+1]]."""
    @property
    def num_computed_tokens(self) -> npt.NDArray[np.uint32]:
        """uint32[S]: tokens already in the cache (= position of the row's first new token)."""
    @property
    def seq_lens(self) -> npt.NDArray[np.uint32]:
        """uint32[S]: num_computed_tokens + query length."""
    @property
    def sample_indptr(self) -> npt.NDArray[np.uint32]:
        """uint32[S+1]: rows to sample; 0 for a mid-prefill chunk, 1 otherwise (1+k verifying k drafts)."""
    @property
    def num_draft_tokens(self) -> npt.NDArray[np.uint32]:
        """uint32[S]: drafts verified in this row (0 without speculative decoding)."""
    @property
    def num_output_tokens(self) -> npt.NDArray[np.uint32]:
        """uint32[S]: output tokens the row's request has before this step (a seeded
        sampler's stream position)."""
    @property
    def committed_token_indptr(self) -> npt.NDArray[np.uint32]:
        """uint32[S+1]: CSR offsets into committed_token_ids."""
    @property
    def committed_token_ids(self) -> npt.NDArray[np.uint32]:
        """uint32[nnz]: output tokens the engine committed to row i's request since the runner
        last saw it in a committed plan (usually the token sampled in its previous step; none
        for a slot in new_request_slots). They are its last outputs, output tokens
        num_output_tokens[i] - n_i .. num_output_tokens[i]: per-request sampler state appends
        them there (re-applying them after a discarded plan changes nothing)."""
    @property
    def sampling(self) -> SamplingArrays: ...
    @property
    def banned_token_indptr(self) -> npt.NDArray[np.uint32]:
        """uint32[S+1]: CSR offsets into banned_token_ids."""
    @property
    def banned_token_ids(self) -> npt.NDArray[np.uint32]:
        """uint32[nnz]: tokens row i must not sample this step (stop tokens before min_tokens)."""
    @property
    def logit_bias_indptr(self) -> npt.NDArray[np.uint32]:
        """uint32[S+1]: CSR offsets into logit_bias_token_ids / logit_bias_values."""
    @property
    def logit_bias_token_ids(self) -> npt.NDArray[np.uint32]:
        """uint32[nnz]: row i's request's logit_bias tokens, ascending (rows that sample only)."""
    @property
    def logit_bias_values(self) -> npt.NDArray[np.float32]:
        """float32[nnz]: the bias added to each of those tokens' logits, before the penalties."""
    @property
    def kv_indptr(self) -> tuple[npt.NDArray[np.uint32], ...]:
        """Per cache group: uint32[S+1] CSR offsets into kv_indices[g]."""
    @property
    def kv_indices(self) -> tuple[npt.NDArray[np.uint32], ...]:
        """Per cache group: uint32[nnz_g] page ids; a sliding-window group lists only in-window
        pages; a recurrent group lists each row's pages_per_state state pages, in byte order; a
        compressed group lists the pages holding the entries closed by seq_len
        (num_entries = seq_len // ratio, in ceil(num_entries / page_size) pages from entry 0)."""
    @property
    def kv_last_page_len(self) -> tuple[npt.NDArray[np.uint32], ...]:
        """Per cache group: uint32[S], tokens in each row's last page (1..page_size); 0 for a
        recurrent group; entries in the last listed page for a compressed group (0 when
        none is listed)."""
    @property
    def slot_mapping(self) -> tuple[npt.NDArray[np.int64], ...]:
        """Per cache group: int64[T], page * page_size + offset where each new token's KV goes;
        -1 = skip (every token of a recurrent group, which has no per-token cache). A
        compressed group: the slot of the entry the token closes (position p with
        (p + 1) % ratio == 0 writes entry p // ratio), -1 for every other token."""
    @property
    def state_slots(self) -> tuple[npt.NDArray[np.uint32], ...]:
        """Per cache group: uint32[S] for a recurrent group (empty for a token group), the first
        page of the row's state (= its first kv_indices entry); byte b of a state lives in the
        row's state page b // page_bytes, at offset b % page_bytes."""
    @property
    def has_initial_state(self) -> tuple[npt.NDArray[np.uint8], ...]:
        """Per cache group: uint8[S] for a recurrent group (empty for a token group), 1 if the
        row's state pages hold its state after num_computed_tokens tokens (continuing, or
        copied from a checkpoint by this plan's copy_pages); 0 if the row starts fresh
        (num_computed_tokens == 0): start from a zero state, ignore the pages' stale bytes."""
    @property
    def copy_pages(self) -> npt.NDArray[np.uint32]:
        """uint32[n, 2] (src, dst) page pairs to copy before the forward, in every layer of every
        recurrent group, reading all sources before writing any destination
        (buf[dst] = buf[src]): own state -> checkpoint after a chunk that ended on a page
        boundary, checkpoint -> own state for a prefix hit (copy-on-write)."""
    @property
    def zero_pages(self) -> npt.NDArray[np.uint32]:
        """uint32[n]: pages to zero after copy_pages and before the forward: pages that last held
        a recurrent state and now hold token K/V (needed only when buffers alias across
        groups: stale state bytes read as K/V can be NaN)."""
    @property
    def block_table(self) -> tuple[npt.NDArray[np.uint32], ...]:
        """Per cache group: uint32[S, max_pages], column j = page holding positions
        [j*page_size, (j+1)*page_size); 0 (the null page) before the window and past the end.
        A recurrent group: uint32[S, pages_per_state], the state pages. A compressed group:
        column j = page holding entries [j*page_size, (j+1)*page_size).
        Derived from kv_indices on first access (the one plan array that is a new array)."""
    @property
    def new_request_slots(self) -> npt.NDArray[np.uint32]:
        """uint32[n]: slots that start serving a request with this plan (reset their state;
        apply after finished_request_slots)."""
    @property
    def new_request_token_indptr(self) -> npt.NDArray[np.uint32]:
        """uint32[n+1]: CSR offsets into new_request_token_ids, in new_request_slots order."""
    @property
    def new_request_token_ids(self) -> npt.NDArray[np.uint32]:
        """uint32[nnz]: every token each new slot's request has so far (prompt, then outputs
        already sampled if it resumes after preemption) — the start of per-request sampler
        state such as penalties; prefix-cache hits never show these tokens in input_ids."""
    @property
    def new_request_num_prompt_tokens(self) -> npt.NDArray[np.uint32]:
        """uint32[n]: how many of each new request's tokens are its prompt."""
    @property
    def finished_request_slots(self) -> npt.NDArray[np.uint32]:
        """uint32[n]: slots whose request finished, was aborted or preempted since the last committed plan."""
    def __len__(self) -> int: ...

@final
class ForwardOutput:
    """What a runner returns for a plan; validated by the engine in ``update``.

    token_ids: uint32[N]; token_indptr: uint32[S+1], row i produced
    token_ids[token_indptr[i]:token_indptr[i+1]]. Optional logprobs: float32[N];
    top_logprob_ids: uint32[N, k]; top_logprobs: float32[N, k]. Optional draft_token_ids:
    uint32[D] and draft_indptr: uint32[S+1] (together): the runner's own drafter's proposals
    (MTP, EAGLE-style heads) for each row's request — the tokens after what the engine commits
    for the row (the agreed prefix plus one) — verified by the next plan; at most
    num_speculative_tokens are used, and they replace the n-gram drafter's for that row.
    prompt_logprobs: float32[M], one per plan.prompt_logprob_targets entry >= 0, in token
    order (required when M > 0), with prompt_top_logprob_ids / prompt_top_logprobs:
    uint32 / float32 [M, k] (together; at least the widest num_prompt_logprobs columns).
    """

    @property
    def token_ids(self) -> Any: ...
    @property
    def token_indptr(self) -> Any: ...
    @property
    def logprobs(self) -> Any | None: ...
    @property
    def top_logprob_ids(self) -> Any | None: ...
    @property
    def top_logprobs(self) -> Any | None: ...
    @property
    def draft_token_ids(self) -> Any | None: ...
    @property
    def draft_indptr(self) -> Any | None: ...
    @property
    def prompt_logprobs(self) -> Any | None: ...
    @property
    def prompt_top_logprob_ids(self) -> Any | None: ...
    @property
    def prompt_top_logprobs(self) -> Any | None: ...
    def __new__(
        cls,
        token_ids: Any,
        token_indptr: Any,
        logprobs: Any | None = None,
        top_logprob_ids: Any | None = None,
        top_logprobs: Any | None = None,
        draft_token_ids: Any | None = None,
        draft_indptr: Any | None = None,
        prompt_logprobs: Any | None = None,
        prompt_top_logprob_ids: Any | None = None,
        prompt_top_logprobs: Any | None = None,
    ) -> ForwardOutput: ...

@final
class RequestOutput:
    """A request's state after a step. ``token_ids`` are all output tokens so far."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def new_token_ids(self) -> list[int]:
        """Output tokens produced by this step."""
    @property
    def num_output_tokens(self) -> int:
        """len(token_ids), without building the list."""
    @property
    def finished(self) -> bool: ...
    @property
    def finish_reason(self) -> _FinishReason | None: ...
    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache when the request was first scheduled."""
    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        """One dict per output token (sampled token and top-k), when requested."""
    def logprobs_from(self, start: int) -> list[dict[int, float]] | None:
        """The entries of output tokens ``start..`` only (a stream's new tokens: the per-step
        cost does not grow with the generation); ``start`` is clamped."""
    @property
    def prompt_logprobs(self) -> list[dict[int, float] | None] | None:
        """When requested: None for the first prompt token, then per prompt token a dict of
        that token's logprob and the top k (all of them once the prompt is computed)."""

class StepError(RuntimeError):
    """Engine.step() failed: runner.forward raised, or its output was rejected. The plan was
    discarded first (nothing committed; pages and slots stay with their requests)."""

    request_ids: list[str]
    """The failed plan's requests, row by row."""
    cause: BaseException
    """The original exception (also ``__cause__``)."""

class InvalidOutputError(StepError, ValueError):
    """Engine.step() failed because runner.forward returned output the engine rejected; the
    message names the field."""

@final
class Engine:
    """The engine: scheduler, paged cache pool with prefix cache, metrics; drives a runner.

    On construction it asks ``runner.cache_spec()`` (if present; default: one full-attention
    layer) for the layer specs, groups them, and calls ``runner.bind_cache(layout)`` (if present).
    """

    def __new__(cls, config: EngineConfig, runner: _RunnerLike) -> Engine: ...
    @property
    def config(self) -> EngineConfig: ...
    @property
    def layout(self) -> CacheLayout: ...
    @property
    def runner(self) -> Any: ...
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None
    ) -> None: ...
    def abort(self, request_id: str, finish_reason: Literal["abort", "stop"] = "abort") -> bool:
        """Abort a waiting or running request; its pages return to the pool now and the next
        step reports it with finish_reason "abort". False if the id is unknown or finished.
        ``finish_reason="stop"``: the same, reported and counted in the metrics as a stop (a
        caller that found a stop string in the request's text)."""
    def schedule(self) -> BatchPlan:
        """Plan the next step. RuntimeError if a plan is pending (call update or discard_plan)."""
    def update(self, plan: BatchPlan, output: ForwardOutput) -> list[RequestOutput]:
        """Validate and commit the runner's output. On ValueError nothing changes and the plan
        stays pending, so update can be retried with a corrected output."""
    def discard_plan(self) -> None:
        """Drop the pending plan without committing it; the next schedule() plans the work again.
        With recurrent cache groups, the plan's requests restart instead (states are advanced
        in place, so the forward may have changed them): back to waiting, to recompute from
        their longest checkpoint."""
    @property
    def async_scheduling(self) -> bool:
        """Whether step() overlaps: EngineConfig.async_scheduling and a runner with
        begin_forward / finish_forward."""
    def step(self) -> list[RequestOutput]:
        """schedule() + runner.forward(plan) + update(plan, output). An empty plan (nothing to
        run) is committed without calling the runner; it carries no lifecycle notices. If
        forward raises (StepError) or its output is invalid (InvalidOutputError, also a
        ValueError), the plan is discarded first: no token is committed, the pages and slots
        it assigned stay with their requests, and the next step() plans the same work again.
        The error's request_ids are the failed plan's requests; its cause (and __cause__) is
        the original exception. KeyboardInterrupt and other non-Exception errors pass through
        unwrapped, after the discard.

        Overlapped (``async_scheduling``): runner.finish_forward() for the plan the last call
        began, update, then (while requests remain) schedule() + runner.begin_forward(next)
        before returning; the first call begins its own plan. A failed finish is a StepError of
        that plan, as above; a failed begin of the next plan is raised by the next step() (this
        call's outputs are returned first). Only step() drives an overlapped engine (a plan is
        pending between calls); discard_plan() drops the begun plan too."""
    @property
    def num_forward_calls(self) -> int:
        """How many plans step() has handed to the runner (forward or begin_forward; empty
        plans are committed without it)."""
    def has_unfinished(self) -> bool: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now (free plus idle cached pages)."""
    def reset_prefix_cache(self) -> None: ...
    def metrics_text(self) -> str:
        """Prometheus text exposition (format 0.0.4) of the engine metrics, prefix ``resin:``."""
    def check_integrity(self) -> None:
        """Raise RuntimeError if any cache-pool or scheduler invariant is broken."""

def paged_attention(
    q: npt.NDArray[np.float32],
    k_cache: npt.NDArray[np.float32] | npt.NDArray[np.int16],
    v_cache: npt.NDArray[np.float32] | npt.NDArray[np.int16] | None,
    out: npt.NDArray[np.float32],
    query_indptr: npt.NDArray[np.uint32],
    seq_lens: npt.NDArray[np.uint32],
    kv_indptr: npt.NDArray[np.uint32],
    kv_indices: npt.NDArray[np.uint32],
    positions: npt.NDArray[np.int64],
    *,
    scale: float,
    value_dim: int,
    window: int | None = None,
    ratio: int = 1,
    softcap: float | None = None,
    sinks: npt.NDArray[np.float32] | None = None,
    threads: int = 1,
    bf16_rounding: bool = False,
) -> None:
    """Attention of ``q`` [T, H, D] over the cache pages the plan's CSR page table lists, read
    in place (rust/kernels/src/paged_attention.rs), written into ``out`` [T, H, value_dim].
    ``k_cache`` / ``v_cache``: [pages, entries, kv_heads, dim], strided views allowed with a
    contiguous last axis; ``v_cache=None``: values are the key rows' first ``value_dim``
    channels. A query at position p sees the row's written keys at positions <= p (and
    > p - window); a compressed group (``ratio`` > 1) counts closed entries, entry e at key
    position (e + 1) * ratio - 1. ``sinks``: one logit per head joining the softmax;
    ``softcap``: tanh(s / c) * c. ``q``, ``out`` and ``sinks`` f32; the caches both f32, or
    both int16 holding bfloat16 bits (``cache.view(torch.int16).numpy()``: numpy has no
    bfloat16), each row widened to f32 exactly as it loads. ``bf16_rounding``: round as a
    bfloat16 model's eager attention does (``q @ k.T`` and its product with the scale rounded to
    bfloat16, the softmax in f32, its probabilities rounded before ``@ v``). Bad shapes, dtypes, misaligned
    arrays, plan indices or an ``out`` sharing bytes with an input raise ValueError before any
    memory is read; the GIL is released while it runs on ``threads`` threads: a parallel
    region of torch's OpenMP team when :func:`openmp_team_available`, else threads of its own."""

def kernels_vectorised() -> bool:
    """Whether the CPU kernels (:func:`paged_attention`) run their vectorised path on this CPU
    (x86-64 with AVX2 + FMA). False: their scalar fallback, which the torch backend leaves off
    unless ``RESIN_TORCH_CPU_KERNEL=1``."""

def openmp_team_available() -> bool:
    """Whether :func:`paged_attention` runs its threads on the process's OpenMP team (torch's
    libgomp / libiomp5 / libomp, looked up among the loaded libraries; Linux). False: on
    threads of its own, which compete with torch's spin-waiting workers for the cores."""

def rotary_embedding(
    x: npt.NDArray[np.float32] | npt.NDArray[np.int16],
    cos: npt.NDArray[np.float32] | npt.NDArray[np.int16],
    sin: npt.NDArray[np.float32] | npt.NDArray[np.int16],
    out: npt.NDArray[np.float32] | npt.NDArray[np.int16],
) -> None:
    """``out = x * cos + rotate_half(x) * sin`` (HF's half-split rotation) for ``x``
    [T, H, D] and per-token tables ``cos`` / ``sin`` [T, D], written into ``out`` (shaped as
    ``x``); C-contiguous, all float32 or all int16 holding bfloat16 bits (torch passes
    ``t.view(torch.int16)``), D even. Each product rounded, then the sum (in bfloat16: each
    rounded to bfloat16), as torch evaluates it: the same floats (rust/kernels/src/rotary.rs).
    Bad shapes, mixed dtypes, Fortran order and an ``out`` sharing bytes with an input raise
    ValueError."""

def rms_norm(
    x: npt.NDArray[np.float32] | npt.NDArray[np.int16],
    weight: npt.NDArray[np.float32] | npt.NDArray[np.int16],
    eps: float,
    out: npt.NDArray[np.float32] | npt.NDArray[np.int16],
) -> None:
    """``out = weight * (x32 * rsqrt(mean(x32²) + eps)).to(dtype)`` for each row of ``x``
    [rows, D] (HF's ``LlamaRMSNorm``), ``weight`` [D], ``out`` shaped as ``x``; C-contiguous,
    all float32 or all int16 holding bfloat16 bits, D >= 8, eps finite and >= 0. The mean sums
    in the order torch's CPU ``sum`` adds a row (eight lanes, four interleaved groups, levels of
    16): torch's floats bit for bit (rust/kernels/src/rms_norm.rs). Bad shapes, mixed dtypes,
    Fortran order and an ``out`` sharing bytes with an input raise ValueError."""

def nucleus_cut(
    logits: npt.NDArray[np.float32],
    probs: npt.NDArray[np.float32],
    rows: npt.NDArray[np.int64],
    top_p: npt.NDArray[np.float32],
    threshold: npt.NDArray[np.float32],
    top_values: npt.NDArray[np.float32],
    top_indices: npt.NDArray[np.int64],
) -> None:
    """For each ``rows[i]`` of ``logits`` / ``probs`` [N, V] (scaled logits and their softmax,
    f32, C-contiguous): the logit where its top-p nucleus of mass ``top_p[i]`` ends, into
    ``threshold[i]`` (the first token, by logit descending, whose float64-summed, float32-rounded
    cumulative probability reaches it, as torch's sort and CPU ``cumsum`` give; the smallest
    logit when none does), and its C largest logits, descending, and their columns into
    ``top_values`` / ``top_indices`` [n, C] (rust/kernels/src/nucleus.rs: a histogram and a
    sort of the nucleus's buckets, not of the row). Bad shapes, rows out of range, non-C order
    and outputs sharing bytes with each other or an input raise ValueError; the GIL is
    released while it runs."""

def argmax(
    logits: npt.NDArray[np.float32],
    tokens: npt.NDArray[np.int64],
    *,
    rows: npt.NDArray[np.int64] | None = None,
    threads: int = 1,
) -> None:
    """Each row's greedy token into ``tokens`` [S]: the first column of the largest logit of
    ``logits`` [S, V] (f32, C-contiguous), a NaN the largest, 0 for a row of ``-inf``; with
    ``rows`` (int64 [n]), ``tokens`` [n] gets row ``rows[i]``'s (a row past ``logits`` raises
    ValueError):
    ``torch.argmax``'s columns exactly (rust/kernels/src/argmax.rs: one vectorised scan against
    the running maximum). Bad shapes, non-C order and ``tokens`` sharing bytes with ``logits``
    raise ValueError; the GIL is released while it runs, the rows split over ``threads``
    (torch's OpenMP team)."""

def inverse_cdf(
    probs: npt.NDArray[np.float32],
    uniforms: npt.NDArray[np.float32],
    tokens: npt.NDArray[np.int64],
) -> None:
    """Each row's inverse-CDF token into ``tokens`` [S]: the first column of ``probs`` [S, V]
    (f32, C-contiguous) whose float32 cumulative sum (float64 additions, in column order)
    exceeds ``min(uniforms[r] * total, nextafter(total, 0))``, the last column when none does:
    torch's ``cumsum`` + ``searchsorted(right=True)``, bit for bit (rust/kernels/src/draw.rs);
    -1 for a row whose total is not positive and finite. Bad shapes, non-C order and
    ``tokens`` sharing bytes with an input raise ValueError; the GIL is released while it
    runs."""

def softmax(x: npt.NDArray[np.float32], lanes: int, out: npt.NDArray[np.float32]) -> None:
    """torch's ``softmax(dim=-1)`` of each row of ``x`` [S, V] (f32, C-contiguous) into ``out``
    [S, V]: SLEEF's ``expf`` and ATen's order of additions over ``lanes`` (8: AVX2, 16:
    AVX-512) lanes, bit for bit where that is torch's float vector (rust/kernels/src/softmax.rs;
    :func:`resin.sampling_kernel.softmax_lanes` checks). Bad shapes or lanes, non-C order and
    ``out`` sharing bytes with ``x`` raise ValueError; the GIL is released while it runs."""

def sample_rows(
    logits: npt.NDArray[np.float32],
    rows: npt.NDArray[np.int64],
    temperature: npt.NDArray[np.float32],
    top_k: npt.NDArray[np.int64],
    top_p: npt.NDArray[np.float32],
    min_p: npt.NDArray[np.float32],
    log_min_p: npt.NDArray[np.float32],
    uniforms: npt.NDArray[np.float32],
    lanes: int,
    tokens: npt.NDArray[np.int64],
    *,
    threads: int = 1,
    bounded: bool = True,
) -> None:
    """The token of each sample i drawn from row ``rows[i]`` of ``logits`` [R, V] (f32,
    C-contiguous, read in place) with its temperature, top-k, top-p, min-p, ``log_min_p``
    (torch's ``log(clamp(min_p, 0))``) and uniform (each [n]) into ``tokens`` [n]: the tokens
    of :func:`resin.sampling_draw.draw_tokens`, bit for bit where ``lanes`` is torch's float
    vector width (rust/kernels/src/sampling.rs); -1 for a sample left to the caller (a
    temperature not positive and finite, a NaN top-p or min-p, a top-k past 256, a row with
    NaN or ``+inf`` or only ``-inf``, overflowing scaled logits, an empty kept set). Bad
    shapes, rows or lanes, non-C order and ``tokens`` sharing bytes with an input raise
    ValueError; the GIL is released while it runs, the samples split over ``threads`` (torch's
    OpenMP team; no token depends on the split). ``bounded=False``: every whole-row draw and
    every top-p cut over the whole row exact, none first decided from cheap exponentials and
    an error bound (rust/kernels/src/bounded_draw.rs, cheap_exp.rs; the same tokens, for A/B
    runs)."""

def top_candidates(
    logits: npt.NDArray[np.float32],
    values: npt.NDArray[np.float32],
    indices: npt.NDArray[np.int64],
) -> None:
    """The n = ``values.shape[1]`` largest logits of each row of ``logits`` [S, V] (f32,
    C-contiguous), descending, into ``values`` [S, n] and their columns into ``indices``
    [S, n]: ``topk(n)``'s values exactly, equal values from any of their columns; NaN counts as
    the largest (rust/kernels/src/candidates.rs: one scan of the row against a rising
    threshold). Bad shapes, non-C order and outputs sharing bytes with each other or
    ``logits`` raise ValueError; the GIL is released while it runs."""

def linear(
    x: npt.NDArray[np.float32] | npt.NDArray[np.int16],
    w: npt.NDArray[np.float32] | npt.NDArray[np.int16],
    bias: npt.NDArray[np.float32] | npt.NDArray[np.int16] | None,
    out: npt.NDArray[np.float32] | npt.NDArray[np.int16],
    *,
    threads: int = 1,
) -> None:
    """``out = x @ w.T (+ bias)`` for ``x`` [rows, in], ``w`` [out_features, in], ``bias``
    [out_features], ``out`` [rows, out_features]: all C-contiguous and of one dtype, float32 or
    int16 holding bfloat16 bits. Each output is one float32 dot product plus the bias, rounded
    once (rust/kernels/src/linear.rs: torch's math in another summation order; each weight row
    read once, for a decode step's few rows). Bad shapes, mixed dtypes, non-C order, misaligned
    arrays and an ``out`` sharing bytes with an input raise ValueError; the GIL is released
    while it runs, on up to ``threads`` threads (at most the cores): torch's OpenMP team when
    the process has one, else threads of its own."""
