"""llama.cpp's side of bench/decode_peers.py's llama_cpp_decoder, run as a process of its own: it loads the model,
says `ready`, then for each line on stdin, until stdin closes, times the prompt and n greedy steps and answers one
line of JSON, [decode tokens/s, prompt tokens/s]. It imports llama-cpp-python and numpy alone (not torch, not the
bench), so it starts in a second and holds little beside the model. Ctrl-C is the benchmark's to handle: this
process ends when its input closes.

    python bench/llama_cpp_runs.py MODEL THREADS CTX N   (the prompt's token ids as JSON on stdin's first line)
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time

import numpy as np


def main() -> None:
    path, threads, ctx, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    prompt_ids = [int(t) for t in json.loads(sys.stdin.readline())]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The answers go to the benchmark alone: whatever the library prints on standard output goes to standard error.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # The optional `peers` extra, imported only where it is installed.
    from llama_cpp import Llama, llama_get_logits_ith

    llm = Llama(model_path=path, n_ctx=ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    vocab = llm.n_vocab()
    print("ready", file=answers, flush=True)
    for _request in sys.stdin:
        llm.reset()
        started = time.perf_counter()
        llm.eval(prompt_ids)
        prompt_seconds = time.perf_counter() - started
        seconds = []
        for _ in range(n):
            started = time.perf_counter()
            # Greedy, with the argmax inside the timed step as our engine's sampling is. Llama.eval keeps no
            # logits unless every position's are kept, so the last token's are read from the context.
            logits = np.ctypeslib.as_array(llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
            llm.eval([int(np.argmax(logits))])
            seconds.append(time.perf_counter() - started)
        speeds = [1.0 / statistics.median(seconds), len(prompt_ids) / prompt_seconds]
        try:
            print(json.dumps(speeds), file=answers, flush=True)
        except BrokenPipeError:
            return  # the benchmark is gone


if __name__ == "__main__":
    main()
