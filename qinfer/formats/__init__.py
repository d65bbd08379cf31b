"""The files we read and write (docs/formats.md): GGUF and PowerInfer GGUF, .gpuidx plans, activation counts,
predictor and calibration directories, and the atomic output every writer goes through. Builds on qinfer.core alone.
"""
