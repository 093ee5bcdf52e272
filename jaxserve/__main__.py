"""`python -m jaxserve ...`: the `jaxserve` command, Ctrl-C handled as under the console script."""

import sys

from jaxserve.console import main

sys.exit(main())
