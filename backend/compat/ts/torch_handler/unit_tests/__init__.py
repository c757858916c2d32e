"""``ts.torch_handler.unit_tests``: the helpers TorchServe's handler tests (and its examples'
tests) import: ``test_utils.mock_context.MockContext``, ``test_utils.model_dir`` and
``models.base_model``. TorchServe's test modules themselves are not provided."""
