"""Integration tests: a real server and real worker processes, on free loopback ports (see
tests/__init__.py)."""
