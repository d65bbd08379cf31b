"""The FFN of a layer: dense or sparse over predicted neurons, and the GPU/CPU split with its neuron cache and cost."""
