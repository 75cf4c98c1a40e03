import sys

from normkit.cli import main

sys.exit(main())
