"""Starting processes: the `fittrain` command line and Accelerate's launch options.

Holds:
    cli      `fittrain launch | env | consolidate | estimate`
    estimate `fittrain estimate module:function`: each process's memory for a model under a layout
    config   Accelerate's launch options and config files, turned into the workers' environment
             (the variables' names: `fittrain.accelerator.launch_env`, which the Accelerator reads)

`fittrain.launchers` (`notebook_launcher`, `debug_launcher`: processes started from Python) sits
beside this package at the top of `fittrain`, where Accelerate has it.

May import: everything below the Trainer (`accelerator`, `checkpoint`, `step`, `distributed`, `common`).
"""
