"""The `qinfer` command line: one module per command group, wiring prep, planner and runtime into commands."""
