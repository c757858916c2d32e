"""``python -m frontend.front``: one front process (its settings on stdin, from its owner)."""

from __future__ import annotations

from frontend.front.process import main

if __name__ == "__main__":
    main()
