import sys

from dtlab.cli import main

sys.exit(main())
