"""`python -m andrea_core ...`: the `andrea` command (cli.main)."""

import sys

from andrea_core.cli import main

sys.exit(main())
