"""Activation profiling: a corpus into token windows, hooks on every FFN, the firing counts written out."""
