"""Loss compare (see titan_lightning/testing/loss_compare.py): python scripts/loss_compare.py --help."""

import sys
from pathlib import Path

# The recipes are checked here before launch: import them as the runs will (PYTHONPATH=this checkout).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lightning.testing.loss_compare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
