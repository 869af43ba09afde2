"""fittrain's built-in callbacks, installed as the package `fittrain.callbacks`."""
