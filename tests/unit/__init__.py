"""Unit tests: one module at a time, in this process, no worker process (see tests/__init__.py)."""
