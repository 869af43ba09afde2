"""Small helpers every layer may use, one place for each small job.

Holds:
    reprs          `short_repr`: a received value, shortened, for error messages
    checks         argument checks that name the argument, the value received and the fix:
                   `check_positive_int`, `check_non_negative_int`, `check_positive_number`,
                   `check_bool`, `check_choice` (and `describe_choices`, `is_int`), raising ValueError or
                   `ArgumentTypeError` (a TypeError and a ValueError)
    nested         the one walker over nested tensors (dicts, lists, tuples, namedtuples,
                   dataclasses on request): `map_tensors`, `iter_tensors`, `is_tensor_tree`
    availability   Accelerate's `is_*_available`: installed packages and present devices
    version        `package_version`: the installed fittrain's version

Layers, top to bottom: callbacks -> trainer -> accelerator -> (step, data, checkpoint, trackers)
-> distributed -> common. This is the bottom: it may import torch and the standard library,
and nothing from fittrain outside `fittrain.common`. Before writing a check or a walker
elsewhere, use or extend the one here.
"""
