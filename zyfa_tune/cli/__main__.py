"""`python -m zyfa_tune.cli`."""

import sys

from . import main

sys.exit(main())
