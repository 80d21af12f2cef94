"""Building a server: checkpoint + runner + options → :class:`ServerContext` → uvicorn.

``build_context(model_dir, runner=..., options=..., **engine_config)`` loads the checkpoint the
way :class:`resin.LLM` does (tokenizer, chat template, the registry's runner, engine defaults),
so the server and the offline API build identical prompts and engines. ``runner`` is None (the
model registry picks the checkpoint's runner, :mod:`resin.registry`), a runner spec as
``--runner`` takes (``torch``, ``null`` — no model compute, for measuring the server —, a
registered model name, a model directory, ``module:Class``), or a runner object. Tool and
reasoning parsers default from ``config.json``'s ``model_type``. ``run_server`` applies the
connection limits of :mod:`resin.server.http_protocol` (header size and timeouts, idle
keep-alive, max connections).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from resin.llm import LLM
from resin.server.context import ServerContext, ServerOptions
from resin.server.engine_loop import EngineLoop
from resin.server.generation import Generator
from resin.server.parsers import REASONING_PARSERS, TOOL_PARSERS, default_parsers
from resin.server.prompt_limits import PromptBound
from resin.server.structured import StructuredOutputs

GIL_SWITCH_INTERVAL_S = 0.0005


def build_context(
    model_dir: str | Path,
    *,
    runner: Any = None,
    options: ServerOptions | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    kv_cache_bytes: int | None = None,
    models_dirs: Sequence[str | Path] = (),
    attention_backend: str | None = None,
    **engine_config: Any,
) -> ServerContext:
    model_dir = Path(model_dir)
    extra: dict[str, Any] = {} if kv_cache_bytes is None else {"kv_cache_bytes": kv_cache_bytes}
    llm = LLM(
        model_dir,
        runner=runner,
        device=device,
        dtype=dtype,
        models_dirs=models_dirs,
        attention_backend=attention_backend,
        **extra,
        **engine_config,
    )
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
    for name, known, flag in (
        (options.tool_parser, TOOL_PARSERS, "--tool-parser"),
        (options.reasoning_parser, REASONING_PARSERS, "--reasoning-parser"),
    ):
        if name is not None and name not in known:
            raise ValueError(f"unknown {flag} {name!r}; known: {', '.join(sorted(known))}")
    if options.chat_template is not None and _is_file(options.chat_template):
        options.chat_template = Path(options.chat_template).read_text(encoding="utf-8")
    loop = EngineLoop(llm.engine, llm.runner)
    config = llm.engine.config
    structured = StructuredOutputs.for_runner(
        llm.runner,
        llm.tokenizer,
        list(getattr(config, "eos_token_ids", None) or llm.tokenizer.eos_token_ids),
        options.tool_parser,
    )
    return ServerContext(
        options=options,
        tokenizer=llm.tokenizer,
        chat_template=llm.chat_template,
        loop=loop,
        generator=Generator(
            loop, llm.tokenizer, structured.registry if structured is not None else None
        ),
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        sampling_defaults=dict(llm.tokenizer.sampling_defaults),
        model_type=llm.model_config.model_type,
        prompt_bound=PromptBound.for_tokenizer(llm.tokenizer),
        structured=structured,
    )


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
    from resin.server.http_protocol import uvicorn_options

    # The engine thread and the event loop pass the GIL back and forth every step; Python's
    # default 5 ms switch interval makes each side wait too long (docs/benchmarks.md, serving).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    uvicorn.run(
        build_app(ctx),
        host=host,
        port=port,
        log_level=log_level,
        **uvicorn_options(ctx.options, ctx.max_num_seqs),
    )
