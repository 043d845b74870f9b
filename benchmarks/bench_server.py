"""Throughput and latency of the OpenAI-compatible server on loopback: a bounded concurrent burst
against the same requests sent one after another.

    python benchmarks/bench_server.py --requests 12 --concurrency 4 --max-tokens 24
    python benchmarks/bench_server.py --requests 12 --concurrency 4 --max-tokens 24 --max-batch-size 4
    python benchmarks/bench_server.py --requests 12 --concurrency 4 --max-tokens 24 --max-batch-size 4 \
        --stream
    python benchmarks/bench_server.py --model qwen2.5-coder-0.5b-instruct --real-questions \
        --requests 8 --concurrency 4 --max-tokens 32 --max-batch-size 4 --stream

Starts `rag-mspoe serve` (embedded model) on a free loopback port, waits for it, measures, stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
from search_prompts import SEARCH_QUESTIONS, search_prompts
from server_process import serve


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, str]:
    """(latency, answer) of one request; streamed, the latency runs to the stream's end."""
    start = time.perf_counter()
    if not body.get("stream"):
        response = await client.post(url, json=body, timeout=600)
        response.raise_for_status()
        return time.perf_counter() - start, response.json()["choices"][0]["message"]["content"]
    pieces = []
    async with client.stream("POST", url, json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                pieces.append(choices[0].get("delta", {}).get("content") or "")
    return time.perf_counter() - start, "".join(pieces)


async def burst(url: str, bodies: list[dict], concurrency: int) -> tuple[float, list[float], list[str]]:
    """(wall time, latencies, answers) of the requests sent `concurrency` at a time."""
    limit = asyncio.Semaphore(concurrency)

    async def limited(client: httpx.AsyncClient, body: dict) -> tuple[float, str]:
        async with limit:
            return await one(client, url, body)

    async with httpx.AsyncClient() as client:
        start = time.perf_counter()
        done = await asyncio.gather(*(limited(client, b) for b in bodies))
        return time.perf_counter() - start, [latency for latency, _ in done], [text for _, text in done]


def report(label: str, wall: float, latencies: list[float]) -> None:
    print(
        f"{label:12} {len(latencies) / wall:8.2f} req/s   p50 {percentile(latencies, 0.5):6.2f} s   "
        f"p90 {percentile(latencies, 0.9):6.2f} s   max {max(latencies):6.2f} s   (wall {wall:.1f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--method", default="mspoe")
    parser.add_argument("--max-batch-size", type=int, default=1, help="the server's cross-request batching")
    parser.add_argument("--stream", action="store_true", help="streamed requests (latency to the last chunk)")
    parser.add_argument("--model", default=None, help="the model to serve (default: the embedded one)")
    parser.add_argument(
        "--real-questions",
        action="store_true",
        help="ask 10-document NQ-open search questions (gold in the middle) instead of short ones",
    )
    args = parser.parse_args()

    options = ("--method", args.method, "--max-batch-size", str(args.max_batch_size))
    if args.model is not None:
        options += ("--model", args.model)
    if args.real_questions:
        conversations = search_prompts(SEARCH_QUESTIONS, args.requests)
    else:
        conversations = [
            [{"role": "user", "content": f"Name {i + 2} animals that live in the sea."}]
            for i in range(args.requests)
        ]
    with serve(*options) as server:
        url = f"{server.base_url}/v1/chat/completions"
        bodies = [
            {
                "model": server.model,
                "messages": messages,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": args.stream,
            }
            for messages in conversations
        ]
        asyncio.run(burst(url, bodies[:1], 1))  # warm up
        print(
            f"{args.requests} {'streamed ' if args.stream else ''}chat requests, "
            f"max_tokens {args.max_tokens}, method {args.method}, "
            f"max batch size {args.max_batch_size}"
        )
        sequential = asyncio.run(burst(url, bodies, 1))
        concurrent = asyncio.run(burst(url, bodies, args.concurrency))
        report("sequential", *sequential[:2])
        report(f"burst of {args.concurrency}", *concurrent[:2])
        same = sum(a == b for a, b in zip(sequential[2], concurrent[2], strict=True))
        print(f"burst answers equal to sequential ones: {same}/{args.requests}")
        print(f"server batching: {httpx.get(f'{server.base_url}/health', timeout=5).json()['batching']}")
        ratio = (args.requests / concurrent[0]) / (args.requests / sequential[0])
        print(
            f"throughput ratio burst/sequential: {ratio:.2f}; median latency ratio: "
            f"{statistics.median(concurrent[1]) / statistics.median(sequential[1]):.2f}"
        )


if __name__ == "__main__":
    main()
