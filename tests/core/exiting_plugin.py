"""A plugin module that calls sys.exit while it is imported (as a "requires X" guard might)."""

import sys

sys.exit(0)
