"""`python -m jaxport.train ...` is `jaxport train ...`: the same parser and the same error
handling (one line per error, never a traceback)."""
import sys

from .._cli import main

argv = sys.argv[1:]
sys.exit(main(argv if argv[:1] == ["train"] else ["train", *argv]))
