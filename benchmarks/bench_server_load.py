"""The server under a hostile load on loopback: clients that leave mid-stream, and oversized bodies.

    python benchmarks/bench_server_load.py                      # embedded model, 32 clients
    python benchmarks/bench_server_load.py --clients 32 --max-tokens 16 --leaver-tokens 512

1. Latency: `clients` streamed chat requests at once, a quarter of which ask for a long answer
   and disconnect after a few chunks. Prints the others' latency against a run without the
   leavers; the server stops a leaver's generation at the next token, so the ratio stays near 1
   (the target is at most 1.5).
2. Memory: a stream of chunked bodies (no Content-Length) far over --max-request-bytes, sent
   by several clients at once. Prints the server's resident memory before and after and its
   peak; the server refuses each body once it passes the limit, so memory stays flat.

Starts `rag-mspoe serve` on a free loopback port, waits for it, measures, stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import httpx
from server_process import serve

MiB = 1 << 20


def memory_mib(pid: int) -> dict[str, float]:
    """Resident memory now (VmRSS) and at its peak (VmHWM), in MiB, from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {name: int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "VmHWM")}


async def stay(client: httpx.AsyncClient, url: str, body: dict) -> float:
    """Seconds until the whole streamed answer has arrived."""
    start = time.perf_counter()
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for _ in response.aiter_lines():
            pass
    return time.perf_counter() - start


async def leave(url: str, body: dict, chunks: int) -> None:
    """Read a few chunks of a long answer, then close the connection."""
    async with httpx.AsyncClient(timeout=600) as own, own.stream("POST", url, json=body) as response:
        response.raise_for_status()
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= chunks:
                return


async def latency_run(url: str, stayers: list[dict], leavers: list[dict], chunks: int) -> list[float]:
    """Latencies of the stayers, all sent at once with the leavers interleaved among them."""
    limits = httpx.Limits(max_connections=len(stayers) + len(leavers))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        staying, leaving = [], []
        for i, body in enumerate(stayers):
            staying.append(asyncio.ensure_future(stay(client, url, body)))
            if i % 3 == 2 and i // 3 < len(leavers):  # one leaver per three stayers: a quarter of all
                leaving.append(asyncio.ensure_future(leave(url, leavers[i // 3], chunks)))
        await asyncio.gather(*staying, *leaving)
    return [task.result() for task in staying]


async def oversized(url: str, clients: int, rounds: int, body_mib: int) -> tuple[int, int]:
    """(bodies refused with 413, MiB the clients got to send) for `clients` x `rounds` chunked bodies."""
    sent = 0

    async def body():
        nonlocal sent
        chunk = b"x" * (64 << 10)
        for _ in range(body_mib * 16):
            sent += len(chunk)
            yield chunk

    async def one(client: httpx.AsyncClient) -> int:
        refused = 0
        for _ in range(rounds):
            response = await client.post(url, content=body(), headers={"content-type": "application/json"})
            refused += response.status_code == 413
        return refused

    async with httpx.AsyncClient(timeout=120) as client:
        refused = await asyncio.gather(*(one(client) for _ in range(clients)))
    return sum(refused), sent // MiB


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--clients", type=int, default=32, help="concurrent clients, a quarter of them leaving"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each staying client asks for")
    parser.add_argument("--leaver-tokens", type=int, default=512, help="tokens each leaving client asks for")
    parser.add_argument("--leave-after", type=int, default=3, help="chunks a leaving client reads first")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the latency comparison")
    parser.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    parser.add_argument("--max-request-bytes", type=int, default=MiB)
    parser.add_argument("--oversized-clients", type=int, default=8)
    parser.add_argument("--oversized-rounds", type=int, default=5)
    parser.add_argument("--oversized-mib", type=int, default=64, help="size of each oversized body")
    args = parser.parse_args()

    options = ["--method", "none", "--max-request-bytes", str(args.max_request_bytes), "--threads", "1"]
    options += ["--max-tokens-limit", str(max(args.max_tokens, args.leaver_tokens))]
    options += ["--model", args.model] if args.model else []
    with serve(*options) as server:
        url = f"{server.base_url}/v1/chat/completions"

        def body(i: int, tokens: int) -> dict:
            question = f"Name {i % 7 + 2} animals that live in the sea."
            messages = [{"role": "user", "content": question}]
            return {
                "model": server.model,
                "messages": messages,
                "max_tokens": tokens,
                "temperature": 0,
                "stream": True,
            }

        n_leavers = args.clients // 4
        stayers = [body(i, args.max_tokens) for i in range(args.clients - n_leavers)]
        leavers = [body(i, args.leaver_tokens) for i in range(n_leavers)]
        asyncio.run(latency_run(url, stayers[:1], [], args.leave_after))  # warm up
        print(
            f"{len(stayers)} streamed requests of {args.max_tokens} tokens at once, then again with "
            f"{n_leavers} more that ask for {args.leaver_tokens} tokens and leave after "
            f"{args.leave_after} chunks ({args.repeats} rounds)"
        )
        ratios = []
        for round_ in range(args.repeats):  # alternated, so load drifts on the machine hit both alike
            alone = asyncio.run(latency_run(url, stayers, [], args.leave_after))
            mixed = asyncio.run(latency_run(url, stayers, leavers, args.leave_after))
            ratios.append(statistics.mean(mixed) / statistics.mean(alone))
            for label, values in (("without leavers", alone), ("with leavers", mixed)):
                mean, median = statistics.mean(values), statistics.median(values)
                print(
                    f"  round {round_ + 1} {label:16} mean {mean:6.2f} s   median {median:6.2f} s   "
                    f"max {max(values):6.2f} s"
                )
        print(
            f"  latency ratio (mean latency with / without leavers): {statistics.median(ratios):.2f} "
            f"(median of {', '.join(f'{r:.2f}' for r in ratios)}; target <= 1.5)"
        )

        before = memory_mib(server.process.pid)
        start = time.perf_counter()
        refused, sent = asyncio.run(
            oversized(url, args.oversized_clients, args.oversized_rounds, args.oversized_mib)
        )
        after = memory_mib(server.process.pid)
        total = args.oversized_clients * args.oversized_rounds
        print(
            f"{total} chunked bodies of {args.oversized_mib} MiB ({args.oversized_clients} clients at once, "
            f"limit {args.max_request_bytes // 1024} KiB): {refused} refused with 413 in "
            f"{time.perf_counter() - start:.1f} s, after the clients had sent {sent} of their "
            f"{total * args.oversized_mib} MiB"
        )
        print(
            f"  server memory: {before['VmRSS']:.0f} MiB before, {after['VmRSS']:.0f} MiB after; "
            f"peak {before['VmHWM']:.0f} -> {after['VmHWM']:.0f} MiB"
        )
        assert httpx.post(url, json={**stayers[0], "stream": False}, timeout=60).status_code == 200


if __name__ == "__main__":
    main()
