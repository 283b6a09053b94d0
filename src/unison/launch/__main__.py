"""``python -m unison.launch ...``: the same as ``unison launch ...``."""

import sys

from unison._launch.cli import launch_main

if __name__ == "__main__":
    sys.exit(launch_main())
