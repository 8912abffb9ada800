import sys

from moelens.cli import main

sys.exit(main())
