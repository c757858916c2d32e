"""Front processes: ``number_of_netty_threads`` > 1 runs that many processes accepting on the
inference port (SO_REUSEPORT), this server process (the owner) and N-1 fronts.

A front holds no state: it parses HTTP, sends each fast-route prediction over its link to the
owner (``frontend/api/http/linked.py``) and writes the answer back; every other connection it
splices, byte for byte, to the owner's inner listener. The owner keeps everything else: the
models, their queues and workers, management, metrics, tokens, the access log. ``owner.py``
starts and supervises the fronts, ``process.py`` is a front (``python -m frontend.front``),
``splice.py`` a spliced connection. docs/frontends.md tells the whole story.
"""
