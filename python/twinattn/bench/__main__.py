"""python -m twinattn.bench: the same as the twinattn-bench command."""

import sys

from .cli import main

sys.exit(main())
