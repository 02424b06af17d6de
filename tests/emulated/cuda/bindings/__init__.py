"""CPU stand-in for ``cuda.bindings`` (NVIDIA's cuda-bindings), for tests only: see driver.py."""
