"""pytest setup of embd's Python tests: support.py (beside this file) is importable, and the
session stops at once, saying what to build, when the build's embd or embctl is missing."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support import BUILD, EMBCTL, EMBD  # noqa: E402 (needs the path above)


def pytest_sessionstart(session: pytest.Session) -> None:
    missing = [str(p) for p in (EMBD, EMBCTL) if not p.exists()]
    if missing:
        pytest.exit(f"{', '.join(missing)} missing: build embd in {BUILD} first "
                    "(EMBD_BUILD_DIR names the build folder)", returncode=1)
