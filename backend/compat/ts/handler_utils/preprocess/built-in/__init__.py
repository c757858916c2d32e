"""``ts.handler_utils.preprocess.built-in``: the default DALI pipeline's definition."""
