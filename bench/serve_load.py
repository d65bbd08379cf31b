"""Load check of `qinfer serve` on loopback: requests/s and p50/p99 latency for 1, 4 and 8 concurrent clients.

    .venv/bin/python bench/serve_load.py                       # builds the default synth model in a temp dir
    .venv/bin/python bench/serve_load.py -m work/tiny/tiny.powerinfer.gguf --requests 48 --max-tokens 32

Every level sends at most --requests completions and stops issuing new ones after --max-seconds; all levels run
against one server in one process, so their ratios compare like with like.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from qinfer.runtime.engine.engine import Engine
from qinfer.runtime.engine.worker import EngineWorker
from qinfer.runtime.server.app import create_app
from qinfer.runtime.server.thread import serve_in_thread

PROMPTS = ["Once upon a time", "Lily found a red ball", "One day, a little fox", "Mia had 5 apples"]


def build_model(out: Path) -> Path:
    from qinfer.prep.convert.convert import convert
    from qinfer.prep.synth.build import SynthShape, build_synth

    report = build_synth(out / "synth", SynthShape(), seed=0, train_steps=0)
    return convert(report.model_dir, out / "tiny.powerinfer.gguf", report.predictor_dir, "f16").outfile


def complete(url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    return time.perf_counter() - t0, int(answer["usage"]["completion_tokens"])


def load_level(url: str, clients: int, requests: int, max_tokens: int, max_seconds: float) -> dict[str, float]:
    deadline = time.perf_counter() + max_seconds
    issued = iter(range(requests))

    def client(index: int) -> list[tuple[float, int]]:
        done = []
        for i in issued:  # shared iterator: the clients together send at most `requests`
            if time.perf_counter() > deadline:
                break
            done.append(complete(url, PROMPTS[(index + i) % len(PROMPTS)], max_tokens))
        return done

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall = time.perf_counter() - t0
    latencies = sorted(lat for lat, _ in results)
    return {
        "requests": len(results),
        "req_s": len(results) / wall,
        "tok_s": sum(tokens for _, tokens in results) / wall,
        "p50": statistics.median(latencies),
        "p99": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", type=Path, help="GGUF to serve; default: build the synth model")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--ctx-size", type=int, default=256)
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-seconds", type=float, default=60.0, help="stop issuing requests after this long")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_model(Path(tmp))
        engine = Engine.open(model, slots=args.slots, ctx_size=args.ctx_size)
        with serve_in_thread(create_app(EngineWorker(engine), model.name)) as url:
            complete(url, PROMPTS[0], 2)  # warm-up
            rows = {c: load_level(url, c, args.requests, args.max_tokens, args.max_seconds) for c in args.clients}
    base = rows[args.clients[0]]
    print(f"model {model.name}, {args.slots} slots, {args.max_tokens} tokens per request, loopback")
    print(f"{'clients':>7} {'requests':>8} {'req/s':>8} {'tok/s':>8} {'p50 s':>7} {'p99 s':>7} {'req/s ratio':>11}")
    for clients, r in rows.items():
        print(
            f"{clients:>7} {r['requests']:>8.0f} {r['req_s']:>8.2f} {r['tok_s']:>8.1f} {r['p50']:>7.3f} "
            f"{r['p99']:>7.3f} {r['req_s'] / base['req_s']:>10.2f}x"
        )


if __name__ == "__main__":
    main()
