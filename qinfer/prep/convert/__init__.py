"""Hugging Face checkpoints to GGUF and PowerInfer GGUF (weights, vocabulary), and quantization to Q4_0/Q8_0."""
