"""The ``titan-lightning`` console script. ``prepare`` runs without loading torch or Lightning (it
needs neither: tokenizers, Jinja2 and numpy), which saves the ~10 s a 2-core machine spends
importing them, and a bad flag of any command is refused before they load (titan_lightning/flags.py);
every other command, and a ``prepare`` that fails, go through titan_lightning/cli.py (the same
messages and exit statuses)."""

import os
import sys
from typing import Optional, Sequence

from titan_lightning.flags import refusal


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    message = refusal(args)
    if message is not None:  # (cli._report's line, without the imports behind it)
        print(f"titan-lightning: error: {message}", file=sys.stderr, flush=True)
        return 2
    if not args or args[0] != "prepare":
        from titan_lightning.cli import main as cli_main  # start-up time: torch and Lightning only when training

        return cli_main(args)
    from titan_lightning.data.prepare import main as prepare_main  # start-up time: prepare imports no torch

    try:
        try:
            return prepare_main(args[1:])
        finally:
            sys.stdout.flush()
    except BrokenPipeError:  # (as cli.main: a reader that stops early)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except Exception as err:  # noqa: BLE001 - bad input: the command line's one line, exit 2
        from titan_lightning.cli import _report  # start-up time: loaded only to report a failure

        _report(err)
        return 2


if __name__ == "__main__":
    sys.exit(main())
