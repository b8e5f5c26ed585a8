"""Run a Python file as `__main__` on every rank: `torchrun -m zckpt_nb.run.script FILE ARGS`.

`launch_module` starts modules (`python -m ...`); a worker a notebook cell wrote (`%%writefile`) is a file, not an
installed module, so this entry point runs it with `runpy.run_path` (the standard library's way to run a file as
`python FILE` would, with `sys.argv` set to FILE ARGS).
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    """Run the file named by the first argument as `__main__`, the rest of the arguments its `sys.argv[1:]`."""
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
