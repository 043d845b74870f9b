"""Throughput of the server on Ray Serve: two replicas against one, on a burst of concurrent
short-prompt requests.

    python benchmarks/bench_ray_serve.py                        # embedded model, bursts of 16
    python benchmarks/bench_ray_serve.py --burst 16 --max-tokens 16 --rounds 2 --repeats 3

A local Ray with --cpus CPUs runs the deployment (`rag_mspoe.connectors.ray_serve`), each replica
on one thread; the layouts are deployed in turn, --rounds times (1, 2, 1, 2, ...: the machine's
speed drifts, so each layout is measured in every stretch of time), and each deployment serves
--repeats bursts after a warm-up request per replica. Prints requests per second per burst and
the median ratio of the two layouts. Beside each deployment it measures the machine's own
ceiling: how much more two processes computing (one torch thread each) get done than one, at
that moment; on a machine shared with other work a second replica cannot add more than that.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import time

import httpx

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "What do bees make?",
    "How many legs has a spider?",
    "Which ocean is the largest?",
    "What gas do plants take in?",
    "Who wrote Hamlet?",
    "What is frozen water called?",
]


async def burst(url: str, size: int, max_tokens: int) -> tuple[float, set[str]]:
    """Seconds for `size` concurrent chat requests, and the replicas that answered them."""
    limits = httpx.Limits(max_connections=size)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(index: int) -> str:
            body = {
                "model": "smollm2-135m-instruct",
                "messages": [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            response = await client.post(f"{url}/v1/chat/completions", json=body)
            response.raise_for_status()
            return response.headers["x-rag-mspoe-replica"]

        started = time.perf_counter()
        replicas = await asyncio.gather(*(one(i) for i in range(size)))
        return time.perf_counter() - started, set(replicas)


def busy(seconds: float) -> int:
    """Matrix products done in `seconds` on one torch thread."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    done, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)
        done += 1
    return done


def two_process_ceiling(seconds: float = 5.0) -> float:
    """Work two processes do at once over the work one process does alone, measured back to back."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        alone = pool.apply(busy, (seconds,))
        both = sum(pool.map(busy, [seconds, seconds]))
    return both / alone


def measure(replicas: int, url: str, args: argparse.Namespace) -> list[float]:
    """Requests per second of each burst with `replicas` replicas deployed."""
    from ray import serve

    from rag_mspoe.connectors.ray_serve import APP_NAME, ReplicaSettings, deployment

    settings = ReplicaSettings(method=args.method, engine={"dtype": args.dtype, "threads": 1})
    serve.run(deployment(settings, replicas=replicas), name=APP_NAME, route_prefix="/")
    asyncio.run(burst(url, 2 * replicas, 2))  # warm-up: every replica answers once
    rates = []
    for _ in range(args.repeats):
        seconds, used = asyncio.run(burst(url, args.burst, args.max_tokens))
        rates.append(args.burst / seconds)
        load = os.getloadavg()[0]
        print(f"  {replicas} replica(s): {rates[-1]:.2f} req/s ({len(used)} answered), load {load:.1f}")
    serve.delete(APP_NAME)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--burst", type=int, default=16, help="concurrent requests per burst")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="times each layout is deployed")
    parser.add_argument("--repeats", type=int, default=3, help="bursts per deployment")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs the local Ray offers")
    parser.add_argument("--method", default="mspoe")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()

    import ray
    from ray import serve

    from rag_mspoe.connectors.ray_serve import NAMESPACE, shutdown

    ray.init(num_cpus=args.cpus, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    url = f"http://127.0.0.1:{args.port}"
    rates: dict[int, list[float]] = {1: [], 2: []}
    ceilings = []
    try:
        for _ in range(args.rounds):
            for replicas in (1, 2):
                rates[replicas] += measure(replicas, url, args)
                ceilings.append(two_process_ceiling())
                print(f"  two processes vs one on this machine now: {ceilings[-1]:.2f}x")
    finally:
        shutdown()
        serve.shutdown()
        ray.shutdown()
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    print(f"median: one replica {one:.2f} req/s, two replicas {two:.2f} req/s: {two / one:.2f}x")
    print(f"median ceiling of the machine (two busy processes vs one): {statistics.median(ceilings):.2f}x")
    print(f"load average at the end (1, 5, 15 min): {os.getloadavg()}")


if __name__ == "__main__":
    main()
