"""Test harness: a recording runner and an engine driver that checks every plan by formula.

``RecordingRunner`` copies each ``BatchPlan`` (``np.array`` of every field) during
``forward`` and answers one token per sampling row, ``token_fn(request_id, seq_len)``.
``Harness`` drives a real ``resin.Engine`` and keeps its own account of every request
(prompt + committed output tokens, runner slots, pages seen), independent of the engine.
After every step it checks the plan against DESIGN.md / ``_core.pyi``:

- dtypes and shapes of every field; live arrays C-contiguous and read-only;
- ``query_indptr`` / ``positions`` / ``num_computed_tokens`` / ``seq_lens`` agree, and
  ``input_ids`` are exactly the request's tokens at those positions;
- ``sample_indptr``: 1 when the row reaches ``num_tokens``, 0 for a mid-prefill chunk;
- decode rows (one sampled token) first, ``num_decode_sequences`` of them;
- per cache group: the page count a row lists (all pages for full attention; pages
  intersecting ``[max(0, num_computed - window + 1), seq_len)`` for a sliding window),
  ``kv_last_page_len``, ``block_table`` rows, ``slot_mapping == page * page_size + offset``,
  page 0 never listed, a page never in two groups, pages written by one row only,
  a request's page at logical index j stable across steps;
- sampling arrays equal the request's ``SamplingParams``; ``banned_token_ids`` are the
  stop tokens (EOS unless ``ignore_eos``) exactly while ``min_tokens`` is not reached;
- ``request_slots`` stable and in ``[0, max_num_seqs)``; ``new_request_slots`` /
  ``finished_request_slots`` are the lifecycle diff since the last committed plan;
- step outputs: only requests that produced tokens (or were aborted), each with exactly
  the token the runner returned, and finish reasons consistent with the params.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import resin

PLAN_ARRAYS = {
    "request_slots": np.uint32,
    "input_ids": np.uint32,
    "positions": np.int64,
    "query_indptr": np.uint32,
    "num_computed_tokens": np.uint32,
    "seq_lens": np.uint32,
    "sample_indptr": np.uint32,
    "num_draft_tokens": np.uint32,
    "banned_token_indptr": np.uint32,
    "banned_token_ids": np.uint32,
    "new_request_slots": np.uint32,
    "finished_request_slots": np.uint32,
}
GROUP_ARRAYS = {
    "kv_indptr": np.uint32,
    "kv_indices": np.uint32,
    "kv_last_page_len": np.uint32,
    "slot_mapping": np.int64,
    "block_table": np.uint32,
}
SAMPLING_ARRAYS = {
    "temperature": np.float32,
    "top_p": np.float32,
    "top_k": np.int32,
    "min_p": np.float32,
    "seed": np.int64,
    "num_logprobs": np.int32,
    "presence_penalty": np.float32,
    "frequency_penalty": np.float32,
    "repetition_penalty": np.float32,
}
SCALARS = (
    "step",
    "num_sequences",
    "num_decode_sequences",
    "num_tokens",
    "padded_num_sequences",
    "page_size",
    "num_cache_groups",
)


def live_array_problems(plan: Any) -> list[str]:
    """Every plan array as handed to the runner: exact dtype, C-contiguous, read-only."""
    arrays: list[tuple[str, Any, Any]] = [(n, getattr(plan, n), t) for n, t in PLAN_ARRAYS.items()]
    for name, dtype in GROUP_ARRAYS.items():
        arrays += [(f"{name}[{g}]", a, dtype) for g, a in enumerate(getattr(plan, name))]
    arrays += [(f"sampling.{n}", getattr(plan.sampling, n), t) for n, t in SAMPLING_ARRAYS.items()]
    problems = []
    for name, array, dtype in arrays:
        if not isinstance(array, np.ndarray):
            problems.append(f"{name} is {type(array).__name__}, not a numpy array")
        elif array.dtype != dtype:
            problems.append(f"{name} has dtype {array.dtype}, expected {np.dtype(dtype)}")
        elif array.flags.writeable or not array.flags.c_contiguous:
            problems.append(
                f"{name}: writeable={array.flags.writeable} c_contiguous={array.flags.c_contiguous}"
            )
    return problems


def copy_plan(plan: Any) -> dict[str, Any]:
    """A plain-dict copy of a plan (every array copied with ``np.array``)."""
    rec: dict[str, Any] = {name: getattr(plan, name) for name in SCALARS}
    rec["len"] = len(plan)
    rec["request_ids"] = list(plan.request_ids)
    rec.update({name: np.array(getattr(plan, name)) for name in PLAN_ARRAYS})
    rec.update({name: tuple(np.array(a) for a in getattr(plan, name)) for name in GROUP_ARRAYS})
    rec["sampling"] = {name: np.array(getattr(plan.sampling, name)) for name in SAMPLING_ARRAYS}
    rec["problems"] = live_array_problems(plan)
    return rec


def default_token(request_id: str, seq_len: int) -> int:
    return 1000 + seq_len


class RecordingRunner:
    """Records every plan; answers ``token_fn(request_id, seq_len)`` for each sampling row."""

    def __init__(self, token_fn: Callable[[str, int], int] = default_token) -> None:
        self.token_fn = token_fn
        self.plans: list[dict[str, Any]] = []

    def forward(self, plan: Any) -> resin.ForwardOutput:
        rec = copy_plan(plan)
        self.plans.append(rec)
        counts = np.diff(rec["sample_indptr"].astype(np.int64))
        rec["returned"] = [
            [self.token_fn(rid, int(rec["seq_lens"][i]))] * int(counts[i])
            for i, rid in enumerate(rec["request_ids"])
        ]
        token_ids = np.array([t for row in rec["returned"] for t in row], dtype=np.uint32)
        indptr = np.concatenate([[0], np.cumsum([len(r) for r in rec["returned"]])])
        k = int(rec["sampling"]["num_logprobs"].max(initial=-1))
        extra = {}
        if k >= 0:  # some row asked for logprobs: answer every row (values are dummies)
            n = len(token_ids)
            extra = dict(
                logprobs=np.full(n, -1.0, np.float32),
                top_logprob_ids=np.tile(np.arange(k, dtype=np.uint32), (n, 1)),
                top_logprobs=np.full((n, k), -2.0, np.float32),
            )
        return resin.ForwardOutput(
            token_ids=token_ids, token_indptr=indptr.astype(np.uint32), **extra
        )


class CacheRunner(RecordingRunner):
    """A recording runner that declares per-layer cache specs and records ``bind_cache``."""

    def __init__(self, specs: list[Any], token_fn: Callable[[str, int], int] = default_token):
        super().__init__(token_fn)
        self.specs = specs
        self.layouts: list[Any] = []

    def cache_spec(self) -> list[Any]:
        return list(self.specs)

    def bind_cache(self, layout: Any) -> None:
        self.layouts.append(layout)


class Harness:
    """Drives an engine and checks each plan and each step's outputs (see module doc)."""

    def __init__(self, config: Any, runner: RecordingRunner | None = None) -> None:
        self.config = config
        self.runner = runner if runner is not None else RecordingRunner()
        self.engine = resin.Engine(config, self.runner)
        layout = self.engine.layout
        self.page_size = layout.page_size
        self.num_pages = layout.num_pages
        self.windows = [
            g.spec.window if g.spec.kind == "sliding_window" else None for g in layout.groups
        ]
        self.eos = set(config.eos_token_ids)
        self.prompts: dict[str, list[int]] = {}
        self.params: dict[str, Any] = {}
        self.outputs: dict[str, list[int]] = {}
        self.final: dict[str, Any] = {}
        self.aborted: set[str] = set()
        self.preempted: list[str] = []
        self.slot_of: dict[str, int] = {}
        self.pending_finished: set[int] = set()
        self.pages: dict[tuple[str, int, int], int] = {}
        self.last_step = -1

    def add(self, rid: str, prompt: list[int], params: Any = None) -> None:
        params = params if params is not None else resin.SamplingParams()
        self.engine.add_request(rid, prompt, params)
        self.prompts[rid], self.params[rid], self.outputs[rid] = list(prompt), params, []

    def abort(self, rid: str) -> bool:
        ok = self.engine.abort(rid)
        if ok:
            self.aborted.add(rid)
            self._release(rid)
        return ok

    def _release(self, rid: str) -> None:
        if rid in self.slot_of:
            self.pending_finished.add(self.slot_of.pop(rid))
        self.pages = {k: v for k, v in self.pages.items() if k[0] != rid}

    def step(self) -> list[Any]:
        before = len(self.runner.plans)
        try:
            outs = self.engine.step()
        except Exception:
            if len(self.runner.plans) > before:
                self.check_plan(self.runner.plans[-1], commit=False)
            raise
        rec = self.runner.plans[-1] if len(self.runner.plans) > before else None
        if rec is not None:
            self.check_plan(rec, commit=True)
        self.apply(outs, rec)
        self.engine.check_integrity()
        return outs

    def run(self, max_steps: int = 2000) -> dict[str, Any]:
        for _ in range(max_steps):
            if not self.engine.has_unfinished():
                return self.final
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def num_tokens(self, rid: str) -> int:
        return len(self.prompts[rid]) + len(self.outputs[rid])

    def stop_ids(self, rid: str) -> set[int]:
        p = self.params[rid]
        return set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos)

    def check_plan(self, rec: dict[str, Any], commit: bool) -> None:
        assert not rec["problems"], rec["problems"]
        s, t, P = rec["num_sequences"], rec["num_tokens"], self.page_size
        rids, slots = rec["request_ids"], rec["request_slots"]
        assert rec["len"] == s == len(rids) == rec["padded_num_sequences"]
        assert rec["page_size"] == P and rec["num_cache_groups"] == len(self.windows)
        assert rec["step"] > self.last_step, (rec["step"], self.last_step)
        for name, n in [
            ("request_slots", s),
            ("num_computed_tokens", s),
            ("seq_lens", s),
            ("num_draft_tokens", s),
            ("query_indptr", s + 1),
            ("sample_indptr", s + 1),
            ("banned_token_indptr", s + 1),
            ("input_ids", t),
            ("positions", t),
        ]:
            assert rec[name].shape == (n,), (name, rec[name].shape, n)
        assert all(a.shape == (s,) for a in rec["sampling"].values())
        qi, si = rec["query_indptr"].astype(np.int64), rec["sample_indptr"].astype(np.int64)
        assert qi[0] == 0 and qi[-1] == t and (np.diff(qi) >= 1).all(), qi
        assert si[0] == 0 and set(np.diff(si).tolist()) <= {0, 1}, si
        assert not rec["num_draft_tokens"].any()
        assert len(set(rids)) == s and len(set(slots.tolist())) == s
        assert all(0 <= x < self.config.max_num_seqs for x in slots.tolist()), slots
        bi = rec["banned_token_indptr"].astype(np.int64)
        assert bi[0] == 0 and bi[-1] == len(rec["banned_token_ids"]) and (np.diff(bi) >= 0).all()
        nd = rec["num_decode_sequences"]
        preempted = self._check_lifecycle(rec, commit)
        known = {k: v for k, v in self.pages.items() if k[0] not in preempted}
        group_pages: list[set[int]] = [set() for _ in self.windows]
        seen_pages: dict[tuple[str, int, int], int] = {}
        for i, rid in enumerate(rids):
            seq = self.prompts[rid] + self.outputs[rid]
            c, sl, q = (
                int(rec["num_computed_tokens"][i]),
                int(rec["seq_lens"][i]),
                int(qi[i + 1] - qi[i]),
            )
            samples = bool(si[i + 1] - si[i])
            assert sl == c + q and sl <= len(seq), (rid, c, q, sl, len(seq))
            assert rec["positions"][qi[i] : qi[i + 1]].tolist() == list(range(c, sl)), rid
            assert rec["input_ids"][qi[i] : qi[i + 1]].tolist() == seq[c:sl], rid
            assert samples == (sl == len(seq)), (rid, sl, len(seq), samples)
            assert (i < nd) == (q == 1 and samples), (rid, i, nd, q, samples)
            self._check_sampling(rec, i, rid, samples)
            for g, window in enumerate(self.windows):
                group_pages[g] |= self._check_group(
                    rec, g, window, i, rid, c, sl, known, seen_pages
                )
        for g in range(len(self.windows)):
            for h in range(g):
                assert not group_pages[g] & group_pages[h], ("page in two groups", g, h)
        if commit:
            self.last_step = rec["step"]
            self.pages = {**known, **seen_pages}

    def _check_sampling(self, rec: dict[str, Any], i: int, rid: str, samples: bool) -> None:
        p, sa = self.params[rid], rec["sampling"]
        expected = {
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": max(p.top_k, 0),
            "min_p": p.min_p,
            "seed": -1 if p.seed is None else p.seed,
            "num_logprobs": -1 if p.logprobs is None else p.logprobs,
            "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty,
        }
        for name, value in expected.items():
            assert sa[name][i] == SAMPLING_ARRAYS[name](value), (rid, name, sa[name][i], value)
        if samples:
            b = rec["banned_token_indptr"]
            banned = set(rec["banned_token_ids"][b[i] : b[i + 1]].tolist())
            want = self.stop_ids(rid) if len(self.outputs[rid]) < p.min_tokens else set()
            assert banned == want, (rid, len(self.outputs[rid]), banned, want)

    def _check_group(
        self,
        rec: dict[str, Any],
        g: int,
        window: int | None,
        i: int,
        rid: str,
        c: int,
        sl: int,
        known: dict[tuple[str, int, int], int],
        seen_pages: dict[tuple[str, int, int], int],
    ) -> set[int]:
        P = self.page_size
        indptr, indices = rec["kv_indptr"][g].astype(np.int64), rec["kv_indices"][g]
        s = rec["num_sequences"]
        assert indptr.shape == (s + 1,) and indptr[0] == 0 and indptr[-1] == len(indices)
        assert (np.diff(indptr) >= 0).all()
        assert rec["kv_last_page_len"][g].shape == (s,)
        assert rec["slot_mapping"][g].shape == (rec["num_tokens"],)
        table = rec["block_table"][g]
        assert table.ndim == 2 and table.shape[0] == s, table.shape
        start = 0 if window is None else max(0, c - window + 1)
        first, last = start // P, (sl - 1) // P
        pages = indices[indptr[i] : indptr[i + 1]].tolist()
        assert len(pages) == last - first + 1, (rid, g, c, sl, window, pages)
        assert rec["kv_last_page_len"][g][i] == sl - last * P
        assert all(0 < x < self.num_pages for x in pages), (rid, g, pages)
        assert len(set(pages)) == len(pages), pages
        row = table[i].tolist()
        assert len(row) >= last + 1
        assert (
            row[first : last + 1] == pages and not any(row[:first]) and not any(row[last + 1 :])
        ), row
        qi = rec["query_indptr"]
        slots = rec["slot_mapping"][g][qi[i] : qi[i + 1]].tolist()
        assert slots == [pages[p // P - first] * P + p % P for p in range(c, sl)], (rid, g, slots)
        for k, page in enumerate(pages):
            key = (rid, g, first + k)
            assert known.get(key, page) == page, ("page moved", key, known[key], page)
            seen_pages[key] = page
        # A page shared with another row must be full and computed in both, at the same index.
        written = {p // P for p in slots}
        for j in range(s):
            if j == i:
                continue
            other = indices[indptr[j] : indptr[j + 1]].tolist()
            assert not written & set(other), ("row writes a page another row lists", rid, g)
            for k, page in enumerate(pages):
                if page in other:
                    assert (first + k + 1) * P <= c, ("shared page not full", rid, page)
        return set(pages)

    def _check_lifecycle(self, rec: dict[str, Any], commit: bool) -> list[str]:
        rids, slots = rec["request_ids"], rec["request_slots"].tolist()
        new, finished = rec["new_request_slots"].tolist(), rec["finished_request_slots"].tolist()
        assert len(set(new)) == len(new) and len(set(finished)) == len(finished), (new, finished)
        assert self.pending_finished <= set(finished), (
            "finished_request_slots misses slots whose request ended since the last plan the runner saw",
            sorted(self.pending_finished),
            finished,
        )
        active = dict(self.slot_of)
        preempted = []
        for slot in set(finished) - self.pending_finished:
            owners = [r for r, s in active.items() if s == slot]
            assert owners, ("finished slot of no live request", slot)
            preempted.append(owners[0])
            del active[owners[0]]
        expected_new = {slot for rid, slot in zip(rids, slots) if rid not in active}
        assert set(new) == expected_new, (rids, slots, new, expected_new)
        for rid, slot in zip(rids, slots):
            assert active.setdefault(rid, slot) == slot, ("slot changed", rid)
        if commit:
            self.slot_of, self.pending_finished = active, set()
            self.preempted += preempted
        return preempted

    def apply(self, outs: list[Any], rec: dict[str, Any] | None) -> None:
        produced = {}
        if rec is not None:
            produced = {rid: row for rid, row in zip(rec["request_ids"], rec["returned"]) if row}
        seen = set()
        for out in outs:
            rid = out.request_id
            assert rid not in seen and rid not in self.final, ("reported twice", rid)
            seen.add(rid)
            prev = self.outputs[rid]
            tokens = list(out.token_ids)
            assert list(out.prompt_token_ids) == self.prompts[rid]
            assert tokens[: len(prev)] == prev and list(out.new_token_ids) == tokens[len(prev) :]
            if out.finish_reason == "abort":
                assert rid in self.aborted and out.finished and tokens == prev, rid
            else:
                assert rid in produced, ("output without a sampled row", rid)
                assert tokens[len(prev) :] == produced[rid], (rid, tokens, produced[rid])
            self.outputs[rid] = tokens
            p = self.params[rid]
            # A stop token ends the request once min_tokens are out; whether the stop token
            # itself may be token number min_tokens is left open (see banned_token_ids).
            last_stops = bool(tokens) and tokens[-1] in self.stop_ids(rid)
            stopped = len(tokens) > p.min_tokens and last_stops
            capped = (
                len(tokens) >= p.max_tokens or self.num_tokens(rid) >= self.config.max_model_len
            )
            assert out.finished == (out.finish_reason is not None)
            if out.finish_reason == "length":
                assert capped, (rid, len(tokens))
            elif out.finish_reason == "stop":
                assert last_stops and len(tokens) >= p.min_tokens, (rid, tokens)
            elif out.finish_reason is None:
                assert not stopped and not capped, (rid, tokens)
            if out.finished:
                self.final[rid] = out
                self._release(rid)
        missing = set(produced) - seen - self.aborted
        assert not missing, ("requests that sampled but were not reported", missing)
