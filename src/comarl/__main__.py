"""``python -m comarl ...`` (and ``torchrun -m comarl train ...``): the ``comarl`` command."""

import sys

from comarl.cli import main

sys.exit(main())
