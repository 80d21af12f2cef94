"""Serving benchmark: N concurrent streaming chat requests against a live ``resin serve``.

Starts ``resin serve`` in a subprocess (so its CPU time can be read from /proc), then for each
concurrency N sends N streaming ``/v1/chat/completions`` requests at once (``ignore_eos``, a
fixed ``max_tokens``) and reports requests/s, output tokens/s, TTFT and inter-token latency
p50/p99 (per chunk, as vllm bench measures them), and the server process's CPU time per
generated token (user + system, from ``/proc/<pid>/stat``).

    .venv/bin/python benchmarks/serve.py --runner null  --concurrency 1 16 128 512
    .venv/bin/python benchmarks/serve.py --runner torch --concurrency 1 16 128 --max-tokens 32

The client is a minimal raw-asyncio HTTP/1.1 SSE reader in this process; on a 2-core machine it
competes with the server for CPU, so wall-clock rates are lower bounds, while the server's CPU
per token is measured on the server process alone. Prints a table; writes JSON to
``benchmarks/results/serve-<runner>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "qwen3"
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S  # utime + stime


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def read_chunked_body(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The pieces of an HTTP/1.1 chunked body, as they arrive."""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()
            return
        data = await reader.readexactly(size)
        await reader.readline()
        yield data


async def one_request(
    host: str, port: int, index: int, max_tokens: int, results: list[dict]
) -> None:
    """One streaming chat request over a raw asyncio connection (HTTP/1.1, chunked SSE): a
    Python HTTP client library costs more CPU per chunk than the server being measured."""
    body = json.dumps(
        {
            "model": "bench",
            "messages": [{"role": "user", "content": f"request {index}"}],
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"
        b"Content-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    await writer.drain()
    status = (await reader.readline()).split()[1]
    if status != b"200":
        raise RuntimeError(f"HTTP {status.decode()}")
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        chunked |= line.lower().startswith(b"transfer-encoding: chunked")
    assert chunked, "the server should stream with chunked transfer encoding"
    chunk_times: list[float] = []
    num_tokens = 0
    pending = b""
    async for piece in read_chunked_body(reader):
        pending += piece
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            chunk = json.loads(event[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                chunk_times.append(time.perf_counter())
    writer.close()
    results.append(
        {
            "ttft_s": chunk_times[0] - started if chunk_times else float("nan"),
            "itl_s": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
            "num_tokens": num_tokens,
        }
    )


async def run_level(
    host: str, port: int, concurrency: int, max_tokens: int, num_rounds: int = 1
) -> dict:
    """``num_rounds`` rounds of ``concurrency`` simultaneous requests, one round after another
    (small levels need several rounds for a CPU time above /proc's 10 ms resolution)."""
    results: list[dict] = []
    started = time.perf_counter()
    for _ in range(num_rounds):
        await asyncio.gather(
            *(one_request(host, port, i, max_tokens, results) for i in range(concurrency))
        )
    elapsed_s = time.perf_counter() - started
    itl = [x for r in results for x in r["itl_s"]]
    ttft = [r["ttft_s"] for r in results]
    num_tokens = sum(r["num_tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "num_rounds": num_rounds,
        "elapsed_s": elapsed_s,
        "num_tokens": num_tokens,
        "requests_per_s": len(results) / elapsed_s,
        "output_tokens_per_s": num_tokens / elapsed_s,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "itl_p50_ms": 1e3 * percentile(itl, 50),
        "itl_p99_ms": 1e3 * percentile(itl, 99),
        "num_chunks": len(itl) + len(results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runner", default="null", help="null or torch")
    parser.add_argument("--model", default=str(FIXTURE))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 128, 512])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--min-tokens",
        type=int,
        default=16384,
        help="repeat a level's round until it generated at least this many",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "resin.cli",
        "serve",
        args.model,
        "--port",
        str(port),
        "--runner",
        args.runner,
        "--served-model-name",
        "bench",
        "--max-num-seqs",
        "512",
        "--max-model-len",
        "1024",
        "--log-level",
        "warning",
    ]
    server = subprocess.Popen(command, cwd=ROOT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.2)
        asyncio.run(run_level("127.0.0.1", port, 4, 8))  # warm-up: connections, first-call costs
        rows = []
        for concurrency in args.concurrency:
            cpu_before = cpu_seconds(server.pid)
            num_rounds = max(1, -(-args.min_tokens // (concurrency * args.max_tokens)))
            row = asyncio.run(
                run_level("127.0.0.1", port, concurrency, args.max_tokens, num_rounds)
            )
            row["server_cpu_s"] = cpu_seconds(server.pid) - cpu_before
            row["server_cpu_us_per_token"] = 1e6 * row["server_cpu_s"] / max(1, row["num_tokens"])
            rows.append(row)
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"runner={args.runner} max_tokens={args.max_tokens}")
    print(
        f"{'N':>5} {'rounds':>6} {'req/s':>8} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
        f"{'ITL p99':>8} {'chunks':>7} {'CPU us/tok':>10}"
    )
    for row in rows:
        print(
            f"{row['concurrency']:>5} {row['num_rounds']:>6} {row['requests_per_s']:>8.1f} "
            f"{row['output_tokens_per_s']:>9.0f} {row['ttft_p50_ms']:>7.1f}ms "
            f"{row['ttft_p99_ms']:>7.1f}ms {row['itl_p50_ms']:>6.2f}ms {row['itl_p99_ms']:>6.2f}ms "
            f"{row['num_chunks']:>7} {row['server_cpu_us_per_token']:>10.1f}"
        )
    out = args.out or ROOT / "benchmarks" / "results" / f"serve-{args.runner}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"runner": args.runner, "max_tokens": args.max_tokens, "rows": rows}, indent=2)
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
