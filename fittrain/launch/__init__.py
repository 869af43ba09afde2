"""Starting processes: the `fittrain` command line and Accelerate's launch options.

Holds:
    cli      `fittrain launch | env | consolidate | ...`
    config   Accelerate's launch options and config files, turned into the workers' environment

May import: everything below the Trainer (`accelerator`, `checkpoint`, `step`, `distributed`, `common`).
"""
