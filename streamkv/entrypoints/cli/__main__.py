"""``python -m streamkv.entrypoints.cli``: the ``streamkv`` command, as the tests and the
benchmarks start a server in a subprocess."""

import sys

from streamkv.entrypoints.cli.main import main

sys.exit(main())
