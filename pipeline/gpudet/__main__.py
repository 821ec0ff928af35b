"""`python -m gpudet`: the command line, as the `gpudet` script and `python -m pipeline` give it."""

import sys

from pipeline.cli import main

sys.exit(main())
