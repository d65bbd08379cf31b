"""The bottom layer: names, model specs, architectures and file formats that every stage shares.

It imports no other package of the project; prep, planner, runtime and the CLI build on it (docs/formats.md).
"""
