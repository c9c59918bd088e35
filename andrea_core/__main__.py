import sys

from andrea_core.cli import main

sys.exit(main())
