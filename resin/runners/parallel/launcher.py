"""The process model of a tensor-parallel runner: one engine, N ranks, the plan to every rank.

Owns :class:`TensorParallelRunner`, the object the engine sees (rank 0, in the engine's
process), and the worker loop of ranks 1..N-1 (:func:`_worker_main`, one spawned process
each). Every rank builds its shard of the model (:mod:`.tensor_parallel`) and joins one
``torch.distributed`` group (gloo on CPU). Per step:

1. rank 0 checks every worker is alive, copies the plan into shared memory
   (:mod:`.plan_transport`) and sends each worker the small layout message on its pipe;
2. every rank runs the same forward — the collectives inside it line up because every rank
   runs the same layers on the same plan;
3. only rank 0 samples and returns the :class:`resin.ForwardOutput`.

Waiting for a step is a pipe read, not a collective, so an idle server never trips a
collective's timeout; inside a step, collectives time out after ``timeout_s``. Workers die
with the engine process (daemon processes; a closed pipe ends their loop) and are stopped by
:meth:`TensorParallelRunner.close`. A rank that crashes — an exception (its traceback comes
back on the pipe) or a killed process — fails the next step with an error naming the rank,
instead of a hang. Imports torch.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
import traceback
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from resin._core import BatchPlan, CacheLayout, ForwardOutput, LayerCacheSpec
from resin.loading import load_model_config
from resin.runners import forward_outputs
from resin.runners.parallel.plan_transport import PlanView, PlanWriter
from resin.runners.parallel.sharding import TensorParallelShard
from resin.runners.parallel.tensor_parallel import resident_weight_bytes, tensor_parallel_runner
from resin.runners.torch.context import LayerContext

DEFAULT_TIMEOUT_S = 120.0
START_TIMEOUT_S = 300.0


class RankFailure(RuntimeError):
    """A tensor-parallel rank failed or exited; the group cannot run another step."""


class _NoSampling:
    """Ranks other than 0 compute the logits (their all-gather) but do not sample."""

    def begin_step(self, plan: Any) -> None:
        pass

    def sample(self, logits: torch.Tensor, plan: Any, rows: Any) -> None:
        return None


def _forward(runner: Any, plan: Any) -> Any:
    """``runner.forward(plan)``; an empty plan under DP attention is an idle pass instead: the
    rank joins each MoE layer's token exchange with no tokens (SGLang's idle batch), and
    returns an empty output."""
    if plan.num_tokens or not getattr(runner, "data_parallel", False):
        return runner.forward(plan)
    hidden = runner.config.hidden_size
    empty = torch.zeros((0, hidden), dtype=runner.dtype, device=runner.device)
    ids = torch.zeros(0, dtype=torch.long, device=runner.device)
    with torch.inference_mode():
        for layer in runner.model.layers:
            if layer.index in runner.moe_layer_indices:
                ctx = LayerContext(
                    index=layer.index,
                    config=runner.config,
                    head_dim=runner.model.head_dim,
                    dtype=runner.dtype,
                    input_ids=ids,
                    positions=ids,
                )
                layer.children["mlp"](empty, runner.child_weights[layer.index]["mlp"], ctx)
    return ForwardOutput(np.zeros(0, np.uint32), np.zeros(1, np.uint32))


def _discard(name: str, tensor: torch.Tensor) -> None:
    """The capture hook of ranks other than 0 (rank 0's captures are the full tensors)."""


def _init_group(init_file: str, rank: int, world_size: int, timeout_s: float) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=dt.timedelta(seconds=timeout_s),
    )


def _worker_main(
    rank: int,
    world_size: int,
    init_file: str,
    model_dir: str,
    device: str,
    dtype: str,
    attention_backend: str | None,
    timeout_s: float,
    num_threads: int | None,
    split: tuple[bool, bool, bool, bool],
    model_directory: str | None,
    conn: Any,
) -> None:
    """Rank ``rank``'s loop: build the shard, then bind / step / report until told to stop or
    the engine's process goes away."""
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        _init_group(init_file, rank, world_size, timeout_s)
        runner = tensor_parallel_runner(
            model_dir,
            rank,
            world_size,
            tensor_parallel=split[0],
            expert_parallel=split[1],
            data_parallel=split[2],
            context_parallel=split[3],
            model_directory=model_directory,
            device=device,
            dtype=getattr(torch, dtype),
            attention_backend=attention_backend,
        )
        if not split[2]:  # data parallel: every rank samples its own requests
            runner.sampler = _NoSampling()  # type: ignore[assignment]
        conn.send(("ready", None))
        while True:
            try:
                op, payload = conn.recv()
            except EOFError:  # the engine's process is gone
                break
            if op == "stop":
                break
            if op == "bind":
                page_size, num_pages = payload
                specs = runner.cache_spec()
                runner.bind_cache(CacheLayout.from_specs(specs, page_size, num_pages))
                conn.send(("bound", None))
            elif op == "step":
                # Parity capture on rank 0 computes every token's logits: so must this rank,
                # for the all-gather to line up (what it captures is dropped).
                runner.capture = _discard if payload["capture"] else None
                out = _forward(runner, PlanView(payload))
                if payload.get("reply"):  # data parallel: this rank's own rows
                    conn.send(("output", _output_arrays(out)))
            elif op == "stats":
                conn.send(("stats", _stats(runner)))
    except Exception:  # noqa: BLE001 - reported to rank 0, which fails the step with it
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _output_arrays(out: ForwardOutput) -> tuple[Any, ...]:
    """A ForwardOutput as plain arrays, for the pipe (a handful per row: token ids, log-probs)."""
    return tuple(
        None if getattr(out, name) is None else np.asarray(getattr(out, name))
        for name in forward_outputs.FIELDS
    )


def _stats(runner: Any) -> dict[str, int]:
    """What one rank holds: weight bytes, and the bytes of its KV-cache buffers once bound
    (the shared page rows, plus any cache with buffers of its own)."""
    shared = list(getattr(runner, "slot_buffers", []))
    storages = {b.untyped_storage().data_ptr() for b in shared}
    own = [
        buffer
        for layer in getattr(runner, "layer_caches", [])
        for buffer in layer.values()
        if buffer.untyped_storage().data_ptr() not in storages
    ]
    cache_bytes = sum(b.numel() * b.element_size() for b in shared + own)
    return {"weight_bytes": resident_weight_bytes(runner), "cache_bytes": cache_bytes}


class TensorParallelRunner:
    """Rank 0 of ``world_size`` parallel ranks of a built-in-family checkpoint: the runner
    the engine drives (``cache_spec`` / ``bind_cache`` / ``forward``). See the module doc.
    ``tensor_parallel`` / ``expert_parallel``: what the ranks split (attention, dense MLPs and
    the vocabulary; the routed experts) — TP, EP alone, or TP+EP over the same ranks.
    ``close()`` stops the workers (also done when the object is collected or the process
    exits)."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        world_size: int,
        *,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
        attention_backend: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        num_threads: int | None = None,
        tensor_parallel: bool = True,
        expert_parallel: bool = False,
        data_parallel: bool = False,
        model_directory: str | os.PathLike[str] | None = None,
        context_parallel: bool = False,
    ):
        if world_size < 2:
            raise ValueError("a parallel runner needs at least 2 ranks")
        if dist.is_initialized():
            raise RuntimeError(
                "this process already belongs to a torch.distributed group: one "
                "tensor-parallel runner per process (close the other first)"
            )
        # Refuse a size the checkpoint's heads / widths do not allow before any process starts.
        split = (tensor_parallel, expert_parallel, data_parallel, context_parallel)
        if context_parallel:
            if tensor_parallel or expert_parallel or data_parallel:
                raise ValueError("context parallelism runs alone (no TP / EP / DP with it)")
        elif model_directory is None:
            TensorParallelShard.of(
                load_model_config(model_dir),
                0,
                world_size,
                tensor_parallel=tensor_parallel,
                expert_parallel=expert_parallel,
            )
        else:
            raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
            TensorParallelShard.of_counts(
                0,
                world_size,
                int(raw["num_attention_heads"]),
                int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
                int(raw["vocab_size"]),
            )
        directory = None if model_directory is None else str(model_directory)
        self.data_parallel = data_parallel
        dtype_name = str(dtype).removeprefix("torch.")
        self.world_size = world_size
        self.timeout_s = timeout_s
        handle, self._init_file = tempfile.mkstemp(prefix="resin-tp-")
        os.close(handle)
        os.unlink(self._init_file)  # the file store creates it
        context = mp.get_context("spawn")
        self._pipes, self._procs = [], []
        for rank in range(1, world_size):
            parent, child = context.Pipe()
            proc = context.Process(
                target=_worker_main,
                args=(
                    rank,
                    world_size,
                    self._init_file,
                    str(model_dir),
                    device,
                    dtype_name,
                    attention_backend,
                    timeout_s,
                    num_threads,
                    split,
                    directory,
                    child,
                ),
                daemon=True,
                name=f"resin-tp-rank{rank}",
            )
            proc.start()
            child.close()
            self._pipes.append(parent)
            self._procs.append(proc)
        self._finalizer = weakref.finalize(self, _shutdown, self._pipes, self._procs)
        try:
            _init_group(self._init_file, 0, world_size, timeout_s)
            self.local = tensor_parallel_runner(
                model_dir,
                0,
                world_size,
                tensor_parallel=tensor_parallel,
                expert_parallel=expert_parallel,
                data_parallel=data_parallel,
                context_parallel=context_parallel,
                model_directory=directory,
                device=device,
                dtype=getattr(torch, dtype_name),
                attention_backend=attention_backend,
            )
            for rank in range(1, world_size):
                self._expect(rank, "ready", START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self.writer = PlanWriter()
        self._rank_writers = [PlanWriter() for _ in range(world_size - 1)] if data_parallel else []
        self.model_config = getattr(self.local, "model_config", None)
        self.bound = False

    # -- the runner protocol ------------------------------------------------------------

    def cache_spec(self) -> list[LayerCacheSpec]:
        """Rank 0's caches: every rank holds the same shapes (its own KV heads), so these are
        the per-rank bytes the engine sizes pages with."""
        return self.local.cache_spec()

    def bind_cache(self, layout: CacheLayout) -> None:
        self._check_alive()
        for pipe in self._pipes:
            pipe.send(("bind", (layout.page_size, layout.num_pages)))
        self.local.bind_cache(layout)
        for rank in range(1, self.world_size):
            self._expect(rank, "bound", self.timeout_s)
        self.bound = True

    def forward(self, plan: BatchPlan) -> ForwardOutput:
        self._check_alive()
        message = self.writer.write(plan)
        message["capture"] = self.local.capture is not None
        for pipe in self._pipes:
            pipe.send(("step", message))
        try:
            out = self.local.forward(plan)
        except Exception as exc:
            self._check_alive(wait_s=1.0)
            raise RankFailure(f"tensor-parallel step failed on rank 0: {exc}") from exc
        self._check_errors()
        return out

    @property
    def capture(self) -> Any:
        """Parity capture (:mod:`resin.runners.torch.paged_runner`): rank 0's hidden states
        after each block's all-reduce are the whole model's, so it captures for the group."""
        return self.local.capture

    @capture.setter
    def capture(self, value: Any) -> None:
        self.local.capture = value

    # -- data parallel: one plan per rank ------------------------------------------------

    def bind_rank(self, rank: int, layout: CacheLayout) -> None:
        """Bind rank ``rank``'s caches alone (data parallel: one engine, and pool, per rank)."""
        self._check_alive()
        if rank == 0:
            self.local.bind_cache(layout)
            return
        self._pipes[rank - 1].send(("bind", (layout.page_size, layout.num_pages)))
        self._expect(rank, "bound", self.timeout_s)

    def forward_all(self, plans: list[BatchPlan]) -> list[ForwardOutput]:
        """Data parallel: rank r runs ``plans[r]`` (its engine's; an empty plan keeps an idle
        rank in the MoE layers' collectives), every rank samples its own rows."""
        if len(plans) != self.world_size:
            raise ValueError(f"{len(plans)} plans for {self.world_size} ranks")
        self._check_alive()
        for pipe, writer, plan in zip(self._pipes, self._rank_writers, plans[1:]):
            message = writer.write(plan)  # a segment per rank: all plans are in flight at once
            message.update(capture=False, reply=True)
            pipe.send(("step", message))
        try:
            outputs = [_forward(self.local, plans[0])]
        except Exception as exc:
            self._check_alive(wait_s=1.0)
            raise RankFailure(f"data-parallel step failed on rank 0: {exc}") from exc
        for rank in range(1, self.world_size):
            arrays = self._expect(rank, "output", self.timeout_s)
            outputs.append(ForwardOutput(*arrays))
        return outputs

    # -- introspection and lifetime -----------------------------------------------------

    def rank_stats(self) -> list[dict[str, int]]:
        """Per rank, the weight bytes and KV-cache bytes it holds (rank 0 first)."""
        stats = [_stats(self.local)]
        for rank, pipe in enumerate(self._pipes, start=1):
            pipe.send(("stats", None))
            stats.append(self._expect(rank, "stats", self.timeout_s))
        return stats

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if getattr(self, "writer", None) is not None:
            self.writer.close()
            self.writer = None  # type: ignore[assignment]
        for writer in getattr(self, "_rank_writers", []):
            writer.close()
        self._rank_writers = []
        self._finalizer()
        if dist.is_initialized():
            dist.destroy_process_group()
        Path(self._init_file).unlink(missing_ok=True)

    def _expect(self, rank: int, op: str, timeout_s: float) -> Any:
        pipe, proc = self._pipes[rank - 1], self._procs[rank - 1]
        waited = 0.0
        while not pipe.poll(0.2):
            waited += 0.2
            if not proc.is_alive():
                raise RankFailure(
                    f"tensor-parallel rank {rank} exited (code {proc.exitcode}) before {op!r}"
                )
            if waited > timeout_s:
                raise RankFailure(f"tensor-parallel rank {rank}: no {op!r} after {timeout_s} s")
        got, payload = pipe.recv()
        if got == "error":
            raise RankFailure(f"tensor-parallel rank {rank} failed:\n{payload}")
        if got != op:
            raise RankFailure(f"tensor-parallel rank {rank}: expected {op!r}, got {got!r}")
        return payload

    def _check_errors(self) -> None:
        for rank, (pipe, proc) in enumerate(zip(self._pipes, self._procs), start=1):
            if pipe.poll():
                try:
                    got, payload = pipe.recv()
                except EOFError:  # its end of the pipe closed: the process is gone
                    proc.join(1.0)
                    raise RankFailure(
                        f"tensor-parallel rank {rank} exited (code {proc.exitcode}): the "
                        "group cannot run; restart the server"
                    ) from None
                if got == "error":
                    raise RankFailure(f"tensor-parallel rank {rank} failed:\n{payload}")

    def _check_alive(self, wait_s: float = 0.0) -> None:
        self._check_errors()
        for rank, proc in enumerate(self._procs, start=1):
            if wait_s:
                proc.join(wait_s)
            if not proc.is_alive():
                raise RankFailure(
                    f"tensor-parallel rank {rank} exited (code {proc.exitcode}): the group "
                    "cannot run; restart the server"
                )


def _shutdown(pipes: list[Any], procs: list[Any]) -> None:
    for pipe in pipes:
        try:
            pipe.send(("stop", None))
        except (OSError, BrokenPipeError):
            pass
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
