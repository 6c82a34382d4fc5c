"""A bounded load test of `trainmem serve` on loopback: REQUESTS POST /api/estimate requests from CLIENTS concurrent
clients (a mix of models, batches, sequences, recipes, LoRA, sharded and model-parallel layouts, and one request in
ten a hostile body that must answer 422), against uvicorn started here.

Prints the error count (any answer but 200 to a good body or 422 to a hostile one), requests per second and latency
percentiles; README.md quotes them.
    python benchmarks/web_load.py [--requests 2000] [--clients 8]
"""

import argparse
import asyncio
import itertools
import socket
import threading
import time

import httpx
import uvicorn

from trainmem.web import create_app

BODIES = [
    {"model": m, "batch": b, "seq": s, "recipe": r, "gpu": "H100-80GB", **extra}
    for m, b, s, r, extra in itertools.product(
        ["llama-3-8b", "llama-2-7b", "mistral-7b", "qwen2.5-0.5b", "gpt2"], [1, 4], [2048, 8192],
        ["mixed-bf16", "pure-bf16"],
        [{}, {"checkpointing": "full"}, {"gpus": 8, "zero": 3}, {"lora": 16, "recipe": "pure-bf16-bf16states"},
         {"gpus": 8, "zero": 3, "offload": "optimizer"}, {"gpus": 8, "tp": 2, "sp": True, "pp": 2, "fsdp": "full"}])
]
HOSTILE = [b'{"model": "gpt2", "headroom": NaN}', b'{"model": "gpt2", "batch": 1e999}', b'{"model": "\\ud800"}',
           b'{"config": {"model_type": "llama", "hidden_size": Infinity}}', b"[" * 2000 + b"]" * 2000,
           b'{"model": "gpt2", "model": "gpt2"}']
"""Bodies the API must refuse with a 422 (tests/test_web.py has the full set)."""


async def client(base: str, queue: asyncio.Queue, latencies: list[float], errors: list[str]) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        while True:
            try:
                body = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            started = time.perf_counter()
            if isinstance(body, bytes):
                response = await http.post("/api/estimate", content=body,
                                           headers={"content-type": "application/json"})
                expected = 422
            else:
                response = await http.post("/api/estimate", json=body)
                expected = 200
            latencies.append(time.perf_counter() - started)
            if response.status_code != expected:
                errors.append(f"{response.status_code} (expected {expected}): {response.text[:200]}")


async def load(base: str, requests: int, clients: int) -> tuple[list[float], list[str], float]:
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(HOSTILE[(i // 10) % len(HOSTILE)] if i % 10 == 9 else BODIES[i % len(BODIES)])
    latencies: list[float] = []
    errors: list[str] = []
    started = time.perf_counter()
    await asyncio.gather(*(client(base, queue, latencies, errors) for _ in range(clients)))
    return latencies, errors, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    latencies, errors, seconds = asyncio.run(load(f"http://127.0.0.1:{port}", args.requests, args.clients))
    server.should_exit = True
    latencies.sort()

    def pct(p: float) -> float:
        return 1000 * latencies[min(len(latencies) - 1, int(p * len(latencies)))]

    print(f"{len(latencies)} requests, {args.clients} clients, {len(BODIES)} distinct bodies and {len(HOSTILE)} "
          f"hostile ones (one request in ten): {len(errors)} errors")
    print(f"{len(latencies) / seconds:.0f} requests/s; latency p50 {pct(0.50):.1f} ms, p99 {pct(0.99):.1f} ms, "
          f"max {1000 * latencies[-1]:.1f} ms")
    for line in errors[:5]:
        print("  error", line)


if __name__ == "__main__":
    main()
