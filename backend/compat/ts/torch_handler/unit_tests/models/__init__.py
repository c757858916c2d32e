"""``ts.torch_handler.unit_tests.models``: small models for handler tests."""
