"""The planner: which FFN neurons live on the GPU, from activation counts, device profiles and a VRAM budget."""
