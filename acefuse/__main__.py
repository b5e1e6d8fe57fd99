import sys

from acefuse.cli import main

sys.exit(main())
