"""Where things are, for tests in any folder under tests/."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root."""
SUPPORT = ROOT / "tests" / "support"
"""The shared test helpers (mp, fakegroup, _fake_cupy, cuda_cpu, the MindSpore scripts)."""
