"""End-to-end tests: whole-system, large-model and long runs, all marked ``slow`` (see
tests/__init__.py)."""
