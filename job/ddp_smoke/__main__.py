import sys

if sys.argv[1:2] == ["preflight"]:  # `python -m ddp_smoke preflight …`: one node's check
    from .preflight import main as preflight_main

    sys.exit(preflight_main(sys.argv[2:]))

from .cli import main  # noqa: E402 — the worker: `python -m ddp_smoke [worker options]`

main()
