"""pytest setup of embd's Python tests: support.py (beside this file) is importable, and no
test starts when the build's embd is missing."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
