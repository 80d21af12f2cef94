"""Building a server: checkpoint + runner + options → :class:`ServerContext` → uvicorn.

``build_context(model_dir, runner=..., options=..., **engine_config)`` loads the checkpoint the
way :class:`resin.LLM` does (tokenizer, chat template, engine defaults), so the server and the
offline API build identical prompts and engines. ``runner`` is ``"torch"`` (the reference
runner), ``"null"`` (a :class:`~resin.runners.scripted.CyclingRunner` over ordinary tokens:
no model compute, for measuring the server), a model name under ``models/``, ``module:Class``,
or a runner object. Tool and reasoning parsers default from ``config.json``'s ``model_type``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from resin.llm import LLM
from resin.server.context import ServerContext, ServerOptions
from resin.server.engine_loop import EngineLoop
from resin.server.generation import Generator
from resin.server.parsers import REASONING_PARSERS, TOOL_PARSERS, default_parsers

GIL_SWITCH_INTERVAL_S = 0.0005
NULL_RUNNER_TEXT = " the quick brown fox jumps over the lazy dog and"


def make_runner(spec: Any, model_dir: Path, device: str, dtype: str) -> Any:
    """A runner object from ``--runner``: torch, null, a models/ name, or module:Class."""
    if not isinstance(spec, str):
        return spec
    if spec == "torch":
        return None  # LLM builds the reference runner
    if spec == "null":
        from resin.runners.scripted import CyclingRunner
        from resin.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_pretrained(model_dir)
        token_ids = [t for t in tokenizer.encode(NULL_RUNNER_TEXT, add_special_tokens=False)
                     if t not in tokenizer.eos_token_ids]
        return CyclingRunner(token_ids)
    if ":" in spec:
        module_name, _, class_name = spec.partition(":")
        runner_class = getattr(importlib.import_module(module_name), class_name)
        return runner_class.from_pretrained(model_dir, device=device, dtype=dtype) \
            if hasattr(runner_class, "from_pretrained") else runner_class()
    try:
        from resin.evals.model_ref import resolve_model
    except ImportError as exc:
        raise ValueError(f"unknown runner {spec!r}: use torch, null, a model name under "
                         "models/, or module:Class") from exc
    return resolve_model(spec).load_runner(device=device, dtype=dtype)


def build_context(model_dir: str | Path, *, runner: Any = "torch",
                  options: ServerOptions | None = None, device: str = "cpu",
                  dtype: str = "float32", kv_cache_bytes: int | None = None,
                  **engine_config: Any) -> ServerContext:
    model_dir = Path(model_dir)
    runner_obj = make_runner(runner, model_dir, device, dtype)
    extra: dict[str, Any] = {} if kv_cache_bytes is None else {"kv_cache_bytes": kv_cache_bytes}
    llm = LLM(model_dir, runner=runner_obj, device=device, dtype=dtype, **extra, **engine_config)
    if options is None:
        options = ServerOptions(served_model_names=[str(model_dir)])
    default_tool, default_reasoning = default_parsers(llm.model_config.model_type)
    if options.tool_parser is None:
        options.tool_parser = default_tool
    elif options.tool_parser == "none":
        options.tool_parser = None
    if options.reasoning_parser is None:
        options.reasoning_parser = default_reasoning
    elif options.reasoning_parser == "none":
        options.reasoning_parser = None
    for name, known, flag in ((options.tool_parser, TOOL_PARSERS, "--tool-parser"),
                              (options.reasoning_parser, REASONING_PARSERS,
                               "--reasoning-parser")):
        if name is not None and name not in known:
            raise ValueError(f"unknown {flag} {name!r}; known: {', '.join(sorted(known))}")
    if options.chat_template is not None and _is_file(options.chat_template):
        options.chat_template = Path(options.chat_template).read_text(encoding="utf-8")
    loop = EngineLoop(llm.engine, llm.runner)
    config = llm.engine.config
    return ServerContext(
        options=options, tokenizer=llm.tokenizer, chat_template=llm.chat_template, loop=loop,
        generator=Generator(loop, llm.tokenizer), max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs, sampling_defaults=dict(llm.tokenizer.sampling_defaults),
        model_type=llm.model_config.model_type)


def _is_file(text: str) -> bool:
    """Whether ``--chat-template`` names a file (else it is the template text itself)."""
    if "\n" in text or "{" in text:
        return False
    try:
        return Path(text).is_file()
    except OSError:  # a name too long for the file system
        return False


def run_server(ctx: ServerContext, host: str, port: int, log_level: str = "info") -> None:
    import sys

    import uvicorn

    from resin.server.app import build_app

    # The engine thread and the event loop pass the GIL back and forth every step; Python's
    # default 5 ms switch interval makes each side wait too long (docs/benchmarks.md, serving).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    uvicorn.run(build_app(ctx), host=host, port=port, log_level=log_level,
                timeout_keep_alive=30)
