"""``python -m precondfx``: the command line (see ``precondfx.cli``)."""
from precondfx.cli import main

raise SystemExit(main())
