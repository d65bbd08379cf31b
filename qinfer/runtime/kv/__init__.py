"""The KV cache (every row, or a window of them) and the token batch that addresses it."""
