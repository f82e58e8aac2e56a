"""jaxamp's benchmarks: standalone scripts, run as ``python -m benchmarks.<name>``."""
