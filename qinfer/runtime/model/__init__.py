"""Model files and their forward pass: the shared layer loop and one block per family, and how a runtime is built."""
