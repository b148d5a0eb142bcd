"""`python tools/benchmark.py ...` = `megarl bench ...` (see `megarl bench --help`)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megarl.benchmarks.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
