"""``python -m backend --socket PATH``: run one worker process (see backend.worker)."""

from __future__ import annotations

import sys

from backend.worker import main

if __name__ == "__main__":
    sys.exit(main())
