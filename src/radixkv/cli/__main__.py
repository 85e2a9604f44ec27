"""``python -m radixkv.cli``: the command line.

Owns: ``python -m radixkv.cli``. Must not touch: anything else."""

import sys

from radixkv.cli import main

sys.exit(main())
