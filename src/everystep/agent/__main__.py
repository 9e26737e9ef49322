import sys

from .._process import exit_after
from .entry import main

# Ended without the interpreter's teardown of torch (most of a second of CPU): by then the agent has
# closed what it wrote and withdrawn its address.
exit_after(lambda: main(sys.argv[1:]))
