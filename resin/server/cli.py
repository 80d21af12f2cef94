"""``resin serve MODEL``: the typer command that starts the HTTP server (vLLM's option names).

The command only parses options; :mod:`resin.server.serve` builds the engine and app. FastAPI,
uvicorn and torch are imported when the command runs, never by ``import resin``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from resin.llm import SPECULATIVE_METHODS, parse_batch_sizes
from resin.server.parsers.registry import REASONING_PARSERS, TOOL_PARSERS


def serve(
    model: Annotated[
        Path,
        typer.Argument(help="HF checkpoint directory (config.json, safetensors, tokenizer.json)."),
    ],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    runner: Annotated[
        str | None,
        typer.Option(
            help="Runner (default: the model registry's for the checkpoint's architecture): "
            "'torch' (the built-in reference runner), 'null' (no model compute: emits fixed "
            "ordinary tokens, for measuring the server), a registered model name, a model "
            "directory, or 'module:Class'."
        ),
    ] = None,
    models_dir: Annotated[
        list[Path] | None,
        typer.Option(
            "--models-dir",
            help="Directory of model directories (made by resin new-model) to "
            "register, or one model directory (repeatable; also $RESIN_MODELS_PATH).",
        ),
    ] = None,
    attention_backend: Annotated[
        str | None,
        typer.Option(help="Attention backend of the torch runners (default: torch)."),
    ] = None,
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(
            "--served-model-name",
            help="Name(s) clients use in 'model' (repeatable); the first "
            "is reported by /v1/models. Default: the MODEL path.",
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="RESIN_API_KEY",
            help="Require this key on /v1/* as 'Authorization: Bearer' or "
            "'x-api-key'. Default: no authentication.",
        ),
    ] = None,
    page_size: Annotated[int, typer.Option(help="KV cache page size in tokens.")] = 16,
    num_pages: Annotated[
        int | None,
        typer.Option(help="KV cache pages (default: sized from --kv-cache-memory-bytes)."),
    ] = None,
    kv_cache_memory_bytes: Annotated[
        int | None,
        typer.Option(
            help="KV cache memory budget in bytes when --num-pages is not given (default 2 GiB)."
        ),
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences in one step.")] = 256,
    max_num_batched_tokens: Annotated[
        int | None, typer.Option(help="Most tokens in one step (prefill chunks are cut to fit).")
    ] = None,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            help="Context length: prompt + output tokens (default: the checkpoint's, at most 8192)."
        ),
    ] = None,
    enable_prefix_caching: Annotated[
        bool,
        typer.Option(
            "--enable-prefix-caching/--no-enable-prefix-caching",
            help="Reuse cached KV pages of shared prompt prefixes.",
        ),
    ] = True,
    speculative_method: Annotated[
        str | None,
        typer.Option(
            help="Speculative decoding: 'ngram' (prompt lookup: drafts from the request's own "
            "text) or 'mtp' (the checkpoint's next-n layer, e.g. DeepSeek-V4's), verified by "
            "the model; identical outputs. Default: off."
        ),
    ] = None,
    num_speculative_tokens: Annotated[
        int, typer.Option(help="Draft tokens per step with --speculative-method (default 3).")
    ] = 3,
    tensor_parallel_size: Annotated[
        int,
        typer.Option(
            min=1,
            help="Tensor-parallel ranks (built-in families; torch.distributed, gloo on CPU): "
            "N - 1 worker processes start with the server and stop with it.",
        ),
    ] = 1,
    expert_parallel_size: Annotated[
        int,
        typer.Option(
            min=1,
            help="Expert-parallel ranks for MoE checkpoints: whole experts dealt over the ranks "
            "(alone, or equal to --tensor-parallel-size: over the same ranks).",
        ),
    ] = 1,
    data_parallel_size: Annotated[
        int,
        typer.Option(
            min=1,
            help="DP attention for MoE checkpoints: D attention replicas, each with its own "
            "engine and requests, the experts dealt over the D ranks.",
        ),
    ] = 1,
    context_parallel_size: Annotated[
        int,
        typer.Option(
            min=1,
            help="Context parallelism: long prefills split over N ranks (full and sliding-window "
            "attention; the KV cache is replicated).",
        ),
    ] = 1,
    tool_parser: Annotated[
        str | None,
        typer.Option(
            help=f"Tool-call parser: {', '.join(sorted(TOOL_PARSERS))}, or none. Default: from "
            "the model type."
        ),
    ] = None,
    reasoning_parser: Annotated[
        str | None,
        typer.Option(
            help=f"Reasoning parser: {', '.join(sorted(REASONING_PARSERS))}, or none. Default: "
            "from the model type."
        ),
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option(
            help="Chat template (a file path or the template text) to use instead of the "
            "checkpoint's."
        ),
    ] = None,
    trust_request_chat_template: Annotated[
        bool,
        typer.Option(help="Accept a 'chat_template' sent in a request (it runs on the server)."),
    ] = False,
    max_queued_requests: Annotated[
        int, typer.Option(help="Requests allowed to wait beyond --max-num-seqs before 429.")
    ] = 4096,
    max_request_body_bytes: Annotated[
        int | None,
        typer.Option(
            help="Largest request body (413 beyond). Default: max(4 MiB, 128 bytes x "
            "--max-model-len)."
        ),
    ] = None,
    max_logprob_entries: Annotated[
        int,
        typer.Option(
            help="Most logprob entries one response may hold: n x max_tokens x (1 + "
            "top_logprobs), times the prompts on /v1/completions (400 beyond)."
        ),
    ] = 1 << 20,
    timeout_keep_alive: Annotated[
        float, typer.Option(help="Seconds an idle keep-alive connection stays open.")
    ] = 75.0,
    timeout_header: Annotated[
        float,
        typer.Option(
            help="Seconds allowed for a request's line and headers to arrive (408 beyond)."
        ),
    ] = 60.0,
    timeout_body: Annotated[
        float,
        typer.Option(
            help="Longest wait in seconds between two reads of a request body (408 beyond)."
        ),
    ] = 60.0,
    max_header_bytes: Annotated[
        int, typer.Option(help="Largest request line + headers in bytes (431 beyond).")
    ] = 32 << 10,
    max_connections: Annotated[
        int | None,
        typer.Option(
            help="Most open connections (503 beyond). Default: --max-num-seqs + "
            "--max-queued-requests + 128."
        ),
    ] = None,
    enable_fastapi_docs: Annotated[
        bool | None,
        typer.Option(
            "--enable-fastapi-docs/--disable-fastapi-docs",
            help="Serve /docs, /redoc and /openapi.json. Default: on, off when --api-key is set.",
        ),
    ] = None,
    allowed_origins: Annotated[
        list[str] | None,
        typer.Option(
            help="Origins browsers may call the API from (CORS; repeat the option). Default: "
            "any ('*'), as vLLM and SGLang; pass one origin to restrict, 'none' for no CORS.",
        ),
    ] = None,
    enforce_eager: Annotated[
        bool,
        typer.Option(
            "--enforce-eager",
            help="No CUDA graphs: every step runs eager (no capture, no padded decode batches).",
        ),
    ] = False,
    async_scheduling: Annotated[
        bool,
        typer.Option(
            "--async-scheduling",
            help="Overlap: plan and begin step n + 1 before step n's outputs go to the "
            "clients, so the device computes while the host streams (torch runners; "
            "docs/architecture.md, 'Overlapped scheduling').",
        ),
    ] = False,
    cuda_graph_batch_sizes: Annotated[
        str | None,
        typer.Option(
            help="Decode batch sizes to capture CUDA graphs at, e.g. 1,2,4,8 (default: 1, 2, "
            "4, every 8 to 256, every 16 to 512, up to --max-num-seqs, and it). Only a torch "
            "runner on CUDA with a graph-safe attention backend (triton) captures; eager "
            "otherwise."
        ),
    ] = None,
    device: Annotated[str, typer.Option(help="torch device for the runner.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Serve MODEL over HTTP: OpenAI /v1/chat/completions, /v1/completions, /v1/responses,
    Anthropic /v1/messages, plus /v1/models, /health, /metrics and /version."""
    from resin.server.context import ServerOptions
    from resin.server.serve import build_context, run_server

    engine_config: dict[str, object] = {
        "page_size": page_size,
        "max_num_seqs": max_num_seqs,
        "enable_prefix_caching": enable_prefix_caching,
    }
    if speculative_method is not None:
        if speculative_method not in SPECULATIVE_METHODS:
            raise typer.BadParameter(
                f"{speculative_method!r}: the speculative methods are: "
                + ", ".join(SPECULATIVE_METHODS),
                param_hint="--speculative-method",
            )
        engine_config["speculative_method"] = speculative_method
        engine_config["num_speculative_tokens"] = num_speculative_tokens
    try:
        graph_sizes = parse_batch_sizes(cuda_graph_batch_sizes)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--cuda-graph-batch-sizes") from exc
    if enforce_eager:
        engine_config["enforce_eager"] = True
    if async_scheduling:
        engine_config["async_scheduling"] = True
    if graph_sizes is not None:
        engine_config["cuda_graph_batch_sizes"] = graph_sizes
    if tensor_parallel_size > 1:
        engine_config["tensor_parallel_size"] = tensor_parallel_size
    if expert_parallel_size > 1:
        engine_config["expert_parallel_size"] = expert_parallel_size
    if data_parallel_size > 1:
        engine_config["data_parallel_size"] = data_parallel_size
    if context_parallel_size > 1:
        engine_config["context_parallel_size"] = context_parallel_size
    for name, value in (
        ("num_pages", num_pages),
        ("max_model_len", max_model_len),
        ("max_num_batched_tokens", max_num_batched_tokens),
    ):
        if value is not None:
            engine_config[name] = value
    options = ServerOptions(
        served_model_names=list(served_model_name or [str(model)]),
        api_key=api_key,
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
        chat_template=chat_template,
        max_queued_requests=max_queued_requests,
        trust_request_chat_template=trust_request_chat_template,
        max_request_body_bytes=max_request_body_bytes,
        max_logprob_entries=max_logprob_entries,
        timeout_keep_alive=timeout_keep_alive,
        timeout_header=timeout_header,
        timeout_body=timeout_body,
        max_header_bytes=max_header_bytes,
        max_connections=max_connections,
        enable_docs=enable_fastapi_docs,
        allowed_origins=cors_origins(allowed_origins),
    )
    try:
        ctx = build_context(
            model,
            runner=runner,
            options=options,
            device=device,
            dtype=dtype,
            kv_cache_bytes=kv_cache_memory_bytes,
            models_dirs=models_dir or (),
            attention_backend=attention_backend,
            **engine_config,
        )
    except (FileNotFoundError, ValueError, TypeError, KeyError, NotImplementedError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    typer.echo(
        f"resin: serving {model} as {options.served_model_names[0]!r} on "
        f"http://{host}:{port} (runner {type(ctx.loop.runner).__name__}, tool parser {options.tool_parser}, "
        f"reasoning parser {options.reasoning_parser}, CUDA graphs "
        f"{list(getattr(ctx.loop.engine.config, 'cuda_graph_batch_sizes', [])) or 'off'})",
        err=True,
    )
    run_server(ctx, host, port, log_level)


def cors_origins(given: list[str] | None) -> list[str]:
    """``--allowed-origins`` as ``ServerOptions.allowed_origins``: any origin when not given,
    none for ``none`` (no CORS headers), else the origins given."""
    if given is None:
        return ["*"]
    return [origin for origin in given if origin.lower() != "none"]
