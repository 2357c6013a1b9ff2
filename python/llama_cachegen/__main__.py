"""`python -m llama_cachegen`: the command-line interface."""

import sys

from .cli import main

sys.exit(main())
