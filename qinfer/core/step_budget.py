"""How many prompt tokens one engine step computes beside the running sequences' next tokens (the engine's
`prefill_chunk`, `qinfer serve --prefill-chunk`); here, free of torch, for the CLI's options."""

# As llama.cpp's physical batch (-ub) and vLLM's first chunked-prefill budget: enough tokens that a chunk's dense
# matmuls read each weight once for many tokens (a prompt's cost per token is near its whole-prompt cost), few
# enough that the running streams wait for one chunk's forward at a time rather than for a whole long prompt.
DEFAULT_PREFILL_CHUNK = 512
