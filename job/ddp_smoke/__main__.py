"""``python -m ddp_smoke`` and the ``ddp-smoke`` command: one node's preflight
(``ddp-smoke preflight …``), else the worker and its report commands (:mod:`ddp_smoke.cli`)."""
import sys

from .cli import main as worker_main
from .preflight import main as preflight_main


def main() -> None:
    if sys.argv[1:2] == ["preflight"]:
        sys.exit(preflight_main(sys.argv[2:]))
    worker_main()


if __name__ == "__main__":
    main()
