"""Tiny models made on the spot (LLaMA, Falcon, OPT) with real tokenizers and predictors, for tests and benchmarks."""
