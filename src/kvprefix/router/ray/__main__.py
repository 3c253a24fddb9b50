"""`python -m kvprefix.router.ray ARGS` is `kvprefix serve --ray ARGS`."""

import sys

from kvprefix.cli import main

sys.exit(main(["serve", "--ray", *sys.argv[1:]]))
