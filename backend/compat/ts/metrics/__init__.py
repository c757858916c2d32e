"""``ts.metrics``: the two small types handlers pass to ``context.metrics``."""
