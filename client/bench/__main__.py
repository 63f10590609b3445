"""``python -m client.bench``: the benchmark harness's command line."""

import sys

from client.bench.cli import main

sys.exit(main())
