"""The files here are Hugging Face Accelerate's test scripts ported to fittrain (and their helpers):
plain scripts that tests/compat/test_accelerate_scripts.py runs under torchrun, not pytest modules, even
though Accelerate named them test_*.py."""

collect_ignore_glob = ["*.py"]
