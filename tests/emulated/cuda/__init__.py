"""CPU stand-in for NVIDIA's ``cuda`` namespace (cuda-bindings), for tests only: see bindings/driver.py."""
