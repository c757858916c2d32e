"""``python -m backend --socket PATH``: run one worker process (see backend.process.worker)."""

from __future__ import annotations

import sys

from backend.process.worker import main

if __name__ == "__main__":
    sys.exit(main())
