"""The serving benchmark: ``streamkv bench serve`` (streamkv/bench/serve.py), runnable from a
checkout as ``python benchmarks/bench_serve.py [--help]``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from streamkv.bench.serve import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
