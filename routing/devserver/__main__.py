"""`python -m routing.devserver ...`: the development inference server's command line."""

import sys

from routing.devserver.cli import main

sys.exit(main(sys.argv[1:]))
