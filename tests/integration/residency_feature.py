"""Whether this tree has issue 36's residency (models beyond ``max_loaded_models`` registered
but paged out, paged in on demand): the core's part of the issue. Tests of what needs it are
marked ``needs_residency`` and skip, saying why, where the config key does not exist yet;
where it does, they assert the rest (describe's ``residency``, the limits) and fail if it is
not there."""

from __future__ import annotations

import pytest

from frontend.config.server import PARSERS

#: The server key of the count limit (DESIGN36.md).
KEY = "max_loaded_models"
HAS_RESIDENCY = KEY in PARSERS

needs_residency = pytest.mark.skipif(
    not HAS_RESIDENCY,
    reason=f"needs issue 36's residency manager: {KEY!r} is not a config key of this tree "
           "(the core's part, branch i36-s, is not merged yet)")
