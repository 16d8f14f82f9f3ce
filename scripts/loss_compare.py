"""Loss compare (see titan_lightning/testing/loss_compare.py): python scripts/loss_compare.py --help."""

import sys

from titan_lightning.testing.loss_compare import main

if __name__ == "__main__":
    sys.exit(main())
