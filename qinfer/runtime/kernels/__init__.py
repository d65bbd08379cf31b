"""Where weights are read and multiplied: the native C kernels, their build and ctypes bindings, the torch
fallback."""
