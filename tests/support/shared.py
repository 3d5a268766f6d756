"""Where the project's shared material (``../shared``: traces, the Pulsar reference) lies.

The traces are MIT-licensed data kept beside the project, not in it. A clone
may sit deeper than the main checkout, so every ancestor's ``shared`` is tried,
after ``$CONTROLLERD_SHARED`` if set. Absent traces fail the tests that need
them with this message: a skip would count a test that never ran as passing.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def shared_dir() -> Path:
    """The first ``shared`` folder with ``traces/`` in it: $CONTROLLERD_SHARED, then ancestors."""
    candidates = (
        [Path(os.environ["CONTROLLERD_SHARED"])] if "CONTROLLERD_SHARED" in os.environ else []
    )
    candidates += [parent / "shared" for parent in ROOT.parents]
    for candidate in candidates:
        if (candidate / "traces").is_dir():
            return candidate
    raise FileNotFoundError(
        "shared traces not found: set CONTROLLERD_SHARED to the folder holding traces/ "
        f"(looked in {', '.join(str(c) for c in candidates)})"
    )


def traces_dir() -> Path:
    return shared_dir() / "traces"
