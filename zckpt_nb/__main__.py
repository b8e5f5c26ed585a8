import sys

from zckpt_nb.cli import main

sys.exit(main())
