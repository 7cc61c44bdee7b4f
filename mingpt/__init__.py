"""mingpt: a Hydra-configured trainer for character-level GPT models, from one CPU to many GPUs."""

import os
import sys

from mingpt import stopping

# Run as a command (`python -m mingpt.generate` imports this package while sys.argv[0] is still
# "-m"; an installed mingpt-generate), Ctrl-C while torch imports ends it with one line, as later: a
# KeyboardInterrupt there printed a traceback, or was lost where torch's import of numpy caught it,
# and the command went on. main.py does it itself; a library import leaves the signals alone.
if sys.argv[0] == "-m" or os.path.basename(sys.argv[0]).startswith("mingpt-"):
    stopping.install()
