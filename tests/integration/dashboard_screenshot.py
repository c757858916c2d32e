"""Take the live page's screenshot for the docs from a real run (not a test):

    .venv/bin/python -m tests.integration.dashboard_screenshot docs/dashboard.png --seconds 75

The same server and load as tests/integration/test_dashboard.py (the ``bucketed`` fixture
handler, batch size 4, two workers, six clients, token authorization on), for ``--seconds``,
then the page in headless Chromium; the PNG is reduced to 128 colours to stay small.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from PIL import Image

from tests.integration.browser import Browser
from tests.integration.test_dashboard import MODEL, Load, start_served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--seconds", type=float, default=75.0, help="load before the shot")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dashboard-shot-") as folder:
        root = Path(folder)
        server, keys = start_served(root)
        try:
            load = Load(f"{server.inference}/predictions/{MODEL}",
                        {"Authorization": f"Bearer {keys['inference']}"})
            load.start()
            try:
                time.sleep(args.seconds)  # the history the page shows
                with Browser(root, width=1280, height=1500) as browser:
                    browser.open(f"{server.management}/dashboard#token="
                                 f"{keys['management']}")
                    browser.wait_for("Number(document.body.dataset.polls) >= 2", "the page")
                    shot = Image.open(browser.screenshot(root / "raw.png")).convert("RGB")
                    height = int(browser.evaluate("document.documentElement.scrollHeight"))
            finally:
                load.finish()
        finally:
            server.stop()
    shot = shot.crop((0, 0, shot.width, min(shot.height, height)))
    shot.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(args.output, optimize=True)
    print(f"{args.output}: {args.output.stat().st_size} bytes; answers {load.statuses}")


if __name__ == "__main__":
    main()
