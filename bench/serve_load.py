"""The server under load, on loopback: tokens/s and p50/p99 request latency at each number of concurrent clients,
for `qinfer serve` and, with --llama-server, llama.cpp's server on the same file, side by side in one run.

    .venv/bin/python bench/serve_load.py                                  # the synth model, built in a temp dir
    .venv/bin/python bench/serve_load.py -m work/bench/7b-slice/7b-slice.gguf --clients 1 8 32 \\
        --llama-server ../peers/llama.cpp/build/bin/llama-server

Each server runs as its own process with as many slots as the most clients (llama.cpp: -np with continuous
batching), each slot --ctx-size tokens, on the threads this process has; the clients are threads here. A level
sends at most --requests completions of --max-tokens tokens (greedy, end of text ignored) and stops issuing new
ones after --max-seconds. Rounds alternate the servers (--rounds), and each level keeps its best round: load from
other processes on a shared machine only ever slows a run.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from decode_peers import peer_problem
from machine import cpu

PROMPTS = ["Once upon a time", "Lily found a red ball", "One day, a little fox", "Mia had 5 apples"]


def build_model(out: Path) -> Path:
    from qinfer.prep.convert.convert import convert
    from qinfer.prep.synth.build import SynthShape, build_synth

    report = build_synth(out / "synth", SynthShape(), seed=0, train_steps=0)
    return convert(report.model_dir, out / "tiny.gguf", None, "f16").outfile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def server(command: list[str], port: int, log: Path) -> Iterator[str]:
    """A server process on `port`, ready (its /health answers 200) before the body runs, stopped after."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.perf_counter() + 600
        while True:
            if process.poll() is not None:
                # Its own words: the log lives in a temporary directory that is gone once this exits.
                said = "\n".join(log.read_text(errors="replace").strip().splitlines()[-5:])
                raise SystemExit(f"{Path(command[0]).name} exited with {process.returncode}:\n{said}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.perf_counter() > deadline:
                raise SystemExit(f"{Path(command[0]).name} did not come up; see {log}")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def complete(url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
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
        "tok_s": sum(tokens for _, tokens in results) / wall,
        "p50": statistics.median(latencies),
        "p99": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
    }


def best(a: dict[str, float] | None, b: dict[str, float]) -> dict[str, float]:
    return b if a is None or b["tok_s"] > a["tok_s"] else a


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--model", type=Path, help="a dense GGUF to serve; default: build the synth model")
    parser.add_argument("--ctx-size", type=int, default=256, help="tokens per slot")
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-seconds", type=float, default=120.0, help="stop issuing requests after this long")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server: adds its columns")
    parser.add_argument("-t", "--threads", type=int, default=0)
    args = parser.parse_args()
    if args.llama_server is not None and (problem := peer_problem("--llama-server", args.llama_server, "llama-server")):
        parser.error(problem)
    threads = args.threads or torch.get_num_threads()
    slots = max(args.clients)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_model(Path(tmp))
        commands = {
            "ours": lambda port: [
                sys.executable, "-m", "qinfer", "serve", "-m", str(model), "--slots", str(slots), "-c",
                str(args.ctx_size), "-t", str(threads), "--port", str(port), "--no-webui",
            ],
        }  # fmt: skip
        if args.llama_server is not None:
            commands["llama.cpp"] = lambda port: [
                str(args.llama_server), "-m", str(model), "-np", str(slots), "-c", str(args.ctx_size * slots),
                "-t", str(threads), "-tb", str(threads), "--port", str(port), "-ctk", "f16", "-ctv", "f16",
            ]  # fmt: skip
        rows: dict[str, dict[int, dict[str, float]]] = {name: {} for name in commands}
        for round_ in range(args.rounds):
            for name, command in commands.items():
                port = free_port()
                with server(command(port), port, Path(tmp) / f"{name}.log") as url:
                    complete(url, PROMPTS[0], 2)  # warm-up
                    for c in args.clients:
                        level = load_level(url, c, args.requests, args.max_tokens, args.max_seconds)
                        rows[name][c] = best(rows[name].get(c), level)
                print(f"round {round_ + 1}: {name} done", file=sys.stderr)
    print(f"{model.name}, {cpu()}, {threads} threads, {slots} slots of {args.ctx_size} tokens, "
          f"{args.max_tokens} tokens per request, loopback, best of {args.rounds} rounds")  # fmt: skip
    names = list(commands)
    header = f"{'clients':>7}" + "".join(f" {n + ' tok/s':>15} {'p50 s':>7} {'p99 s':>7}" for n in names)
    if len(names) == 2:
        header += f" {'tok/s ratio':>11} {'p99 ratio':>9}"
    print(header)
    for c in args.clients:
        line = f"{c:>7}" + "".join(
            f" {rows[n][c]['tok_s']:>15.1f} {rows[n][c]['p50']:>7.3f} {rows[n][c]['p99']:>7.3f}" for n in names
        )
        if len(names) == 2:
            ours, theirs = rows["ours"][c], rows["llama.cpp"][c]
            line += f" {ours['tok_s'] / theirs['tok_s']:>10.2f}x {ours['p99'] / theirs['p99']:>8.2f}x"
        print(line)


if __name__ == "__main__":
    main()
