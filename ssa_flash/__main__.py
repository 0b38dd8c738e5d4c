"""``python -m ssa_flash``: the self-check, :mod:`ssa_flash.selfcheck`.

Its code lives in that importable module because the checks' worker processes are spawned and
unpickle their function by module name: a package's ``__main__`` is not re-imported in a spawned
child, so functions defined here would not be found there."""
import sys

from .selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
