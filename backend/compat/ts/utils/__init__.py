"""``ts.utils``: only ``ts.utils.util`` is provided."""
