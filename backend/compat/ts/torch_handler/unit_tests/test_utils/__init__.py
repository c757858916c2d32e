"""``ts.torch_handler.unit_tests.test_utils``: a context for handler tests (``mock_context``)
and fetching test models (``model_dir``)."""
