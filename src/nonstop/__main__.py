import sys

from nonstop.cli import main

sys.exit(main())
