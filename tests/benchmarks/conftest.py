"""The benchmarks import each other as scripts do (benchmarks/ first on the path)."""

import sys

from turnrl.config import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
