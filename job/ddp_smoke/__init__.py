"""ddp-smoke: checks that distributed PyTorch training really works on a cluster.

Run ``python -m ddp_smoke --help`` for the manual.
"""
__version__ = "0.1.0"
