"""The backend's processes: a worker's loop and its protocol with the frontend (``worker.py``,
run by ``python -m backend``), the fork server workers are forked from (``forkserver.py``, with
what it imports ahead, ``preload.py``, what a forked child resets, ``forked.py``, and what of
its modules an archive shadows, ``shadowing.py``), and the owner of weights shared between a
GPU's workers (``weights_owner.py``)."""
