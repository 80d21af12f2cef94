"""The engine loop: one thread that owns ``engine.step()``, and the asyncio side that feeds it.

``EngineLoop`` calls ``engine.step()`` (schedule → ``runner.forward`` → update, all in the
engine) in a daemon thread and hands each step's :class:`resin.RequestOutput` objects to the
asyncio event loop of the HTTP server. Its guarantees:

- ``add`` and ``abort`` never touch the engine from the event loop (its lock is held while the
  engine plans and commits a step, and the event loop must not wait on it): they register the
  request's :class:`OutputQueue` and append a command that the engine thread applies, in
  order, before planning its next step. An add the engine rejects fails its queue with
  :class:`RequestRejected`; handlers check what they can (context length, sampling values)
  beforehand, so that is rare.
- One ``call_soon_threadsafe`` per burst of steps, not per step or per token: the engine thread
  appends outputs to a deque and schedules a dispatch only when none is pending, so a slow event
  loop receives several steps' outputs at once (and streams them as one chunk).
- A runner that raises, or returns output the engine rejects, fails only the requests of that
  plan: ``engine.step()`` discards the plan and raises :class:`resin.StepError` naming its
  requests; they are aborted (their pages return to the pool) and their queues receive the
  error; the loop keeps serving everyone else.
- ``abort`` (a client went away) frees the request's pages at once; the engine reports the
  abort on its next step, and the queue is dropped.

It never touches HTTP, text or JSON: that is :mod:`resin.server.generation`'s job.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Iterable
from typing import Any

from resin._core import Engine, RequestOutput, SamplingParams, StepError

IDLE_WAIT_S = 0.5  # the engine thread re-checks ``running`` this often when there is no work
ADD, ABORT, STOP = "add", "abort", "stop"
# The engine thread wakes the event loop at most this often: with a runner faster than this
# per step, tokens batch into fewer, larger chunks instead of one cross-thread round per step;
# with a real model (milliseconds per step) every step's outputs go at once.
MIN_WAKE_INTERVAL_S = 0.0005
# This many failed steps in a row (every plan's runner call raised or was rejected) means the
# runner is broken for good (e.g. a sticky CUDA error): the loop stops and /health turns 503.
MAX_CONSECUTIVE_FAILED_STEPS = 16


class RunnerFailure(RuntimeError):
    """The runner raised, or returned output the engine rejected, while running a request."""


class RequestRejected(ValueError):
    """The engine refused a request (e.g. a prompt over ``max_model_len``)."""


class OutputQueue:
    """Outputs of one or more engine requests (the ``n`` choices of one API request), consumed
    by one coroutine. ``choice_of`` maps engine request id → choice index."""

    __slots__ = ("choice_of", "items", "event", "error")

    def __init__(self) -> None:
        self.choice_of: dict[str, int] = {}
        self.items: collections.deque[RequestOutput] = collections.deque()
        self.event = asyncio.Event()
        self.error: BaseException | None = None

    def push(self, output: RequestOutput) -> None:
        self.items.append(output)
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()

    async def drain(self) -> list[RequestOutput]:
        """Everything that arrived since the last call (waits for at least one output)."""
        while not self.items:
            if self.error is not None:
                raise self.error
            self.event.clear()
            await self.event.wait()
        items = list(self.items)
        self.items.clear()
        return items


class EngineLoop:
    """Drives ``engine`` in a background thread and routes outputs to asyncio queues."""

    def __init__(self, engine: Engine, runner: Any) -> None:
        self.engine = engine
        self.runner = runner  # the engine's runner: engine.step() calls its forward
        self._queues: dict[str, OutputQueue] = {}
        self._commands: collections.deque[tuple[Any, ...]] = collections.deque()
        self._outbox: collections.deque[tuple[list[RequestOutput], dict[str, BaseException]]] = (
            collections.deque()
        )
        self._dispatch_pending = False
        self._last_wake_s = 0.0
        self._dispatch_lock = threading.Lock()
        self._wake = threading.Event()
        self._running = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.fatal_error: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._running = True
        self._thread = threading.Thread(target=self._run, name="resin-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal_error is None

    @property
    def num_active_requests(self) -> int:
        """Engine requests added and not yet reported finished (waiting or running)."""
        return len(self._queues)

    # -- called on the event loop's thread ----------------------------------------------------
    def add(
        self, request_ids: Iterable[str], prompt_token_ids: list[int], params: list[SamplingParams]
    ) -> OutputQueue:
        """Queue one engine request per id (the choices of one API request), sharing one
        output queue. The engine thread adds them before its next step; if the engine rejects
        one, the queue fails with :class:`RequestRejected` and its siblings are aborted."""
        queue = OutputQueue()
        for index, request_id in enumerate(request_ids):
            queue.choice_of[request_id] = index
            self._queues[request_id] = queue
        self._commands.append((ADD, queue, prompt_token_ids, params))
        self._wake.set()
        return queue

    def abort(self, queue: OutputQueue) -> None:
        """Abort every unfinished request of ``queue``: the engine thread frees their pages
        before it plans its next step."""
        ids = [rid for rid in queue.choice_of if self._queues.pop(rid, None) is not None]
        if ids:
            self._commands.append((ABORT, ids))
            self._wake.set()

    def abort_request(self, request_id: str, stopped: bool = False) -> None:
        """Abort one engine request, the others go on; ``stopped``: a choice that hit a stop
        string, ended with finish reason "stop" (so counted in the metrics)."""
        if self._queues.pop(request_id, None) is not None:
            self._commands.append((STOP if stopped else ABORT, [request_id]))
            self._wake.set()

    def _dispatch(self) -> None:
        with self._dispatch_lock:
            self._dispatch_pending = False
            batches = list(self._outbox)
            self._outbox.clear()
        for outputs, errors in batches:
            for request_id, error in errors.items():
                queue = self._queues.pop(request_id, None)
                if queue is not None:
                    queue.fail(error)
            for output in outputs:
                request_id = output.request_id
                queue = self._queues.get(request_id)
                if queue is None:
                    continue  # aborted by its client: nobody is listening
                if output.finished:
                    del self._queues[request_id]
                queue.push(output)

    # -- the engine thread --------------------------------------------------------------------
    def _post(self, outputs: list[RequestOutput], errors: dict[str, BaseException]) -> None:
        """Queue a step's outputs and have the event loop dispatch them: at once, or — when it
        was woken less than ``MIN_WAKE_INTERVAL_S`` ago — when that interval is up, so a
        runner faster than the interval does not cost one event-loop round per step. Outputs
        never wait longer than the interval."""
        assert self._loop is not None
        with self._dispatch_lock:
            if outputs or errors:
                self._outbox.append((outputs, errors))
            if self._dispatch_pending or not self._outbox:
                return
            self._dispatch_pending = True
            now = time.perf_counter()
            delay_s = self._last_wake_s + MIN_WAKE_INTERVAL_S - now
            self._last_wake_s = now + max(delay_s, 0.0)
        if delay_s > 0:
            self._loop.call_soon_threadsafe(self._loop.call_later, delay_s, self._dispatch)
        else:
            self._loop.call_soon_threadsafe(self._dispatch)

    def _run(self) -> None:
        engine = self.engine
        num_failed_steps = 0
        try:
            while self._running:
                errors = self._apply_commands()
                if errors:
                    self._post([], errors)
                if not engine.has_unfinished():
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                outputs, errors, ran_runner = self._step()
                self._post(outputs, errors)
                if errors:  # the runner raised or its output was rejected
                    num_failed_steps += 1
                elif ran_runner:
                    num_failed_steps = 0
                if num_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
                    raise RuntimeError(
                        f"the runner failed {num_failed_steps} steps in a row; "
                        f"last error: {next(iter(errors.values()))}"
                    )
        except BaseException as exc:  # an engine bug: fail everyone, /health turns 503
            self.fatal_error = exc
            if self._loop is not None and not self._loop.is_closed():
                error = RuntimeError(f"the engine loop stopped: {exc!r}")
                self._loop.call_soon_threadsafe(self._fail_all, error)

    def _apply_commands(self) -> dict[str, BaseException]:
        """Add and abort what the event loop asked for, in order; rejected adds → errors."""
        errors: dict[str, BaseException] = {}
        commands = self._commands
        while commands:
            command = commands.popleft()
            if command[0] in (ABORT, STOP):
                for request_id in command[1]:
                    self.engine.abort(request_id, command[0])
                continue
            _, queue, prompt_token_ids, params = command
            added: list[str] = []
            try:
                for request_id, request_params in zip(queue.choice_of, params):
                    self.engine.add_request(request_id, prompt_token_ids, request_params)
                    added.append(request_id)
            except ValueError as exc:
                for request_id in added:
                    self.engine.abort(request_id)
                error = RequestRejected(str(exc))
                errors.update((request_id, error) for request_id in queue.choice_of)
        return errors

    def _step(self) -> tuple[list[RequestOutput], dict[str, BaseException], bool]:
        """One ``engine.step()``: (outputs, per-request errors, whether the runner was called —
        a plan with no rows is committed without it, e.g. one that only reports aborts)."""
        engine = self.engine
        num_forward_calls = engine.num_forward_calls
        try:
            outputs = engine.step()
        except StepError as exc:  # the engine already discarded the plan
            error = RunnerFailure(f"the runner failed on this request: {exc.cause}")
            error.__cause__ = exc.cause
            for request_id in exc.request_ids:
                engine.abort(request_id)
            return [], {request_id: error for request_id in exc.request_ids}, True
        return outputs, {}, engine.num_forward_calls != num_forward_calls

    def _fail_all(self, error: BaseException) -> None:
        self._dispatch()  # outputs posted before the failure still reach their requests
        queues = set(self._queues.values())
        self._queues.clear()
        for queue in queues:
            queue.fail(error)
