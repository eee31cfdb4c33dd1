"""``python -m gpuload``: the ``gpuload`` command."""

import sys

from .tools.cli import main

sys.exit(main())
