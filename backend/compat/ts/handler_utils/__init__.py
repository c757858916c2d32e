"""``ts.handler_utils``: intermediate responses (``utils``) and handler timing (``timer``)."""
