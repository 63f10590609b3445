"""``python -m bench``: the benchmark harness's command line."""

import sys

from bench.cli import main

sys.exit(main())
