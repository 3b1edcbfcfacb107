"""``python -m ddp_smoke`` and the ``ddp-smoke`` command: the worker, or the command its first
word names (:mod:`ddp_smoke.cli`)."""
from .cli import main

if __name__ == "__main__":
    main()
