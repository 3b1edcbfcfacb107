"""A real headless browser (Debian's chromium) for the page tests, installed when missing.

The page carries no script and a Content-Security-Policy that blocks every load, so anything
chromium writes to the console while loading it (a CSP violation, a failed load, a parse
error) is an error: chromium logs every console message to stderr as ``…:CONSOLE…`` with
``--enable-logging=stderr --v=0``. ``tests/outputs/test_page_browser.py`` checks that this
detector fires on a page that does misbehave.
"""
from __future__ import annotations

import io
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.sandbox import tools

LOAD_TIMEOUT_S = 60
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--enable-logging=stderr", "--v=0"]


class MissingBrowser(RuntimeError):
    """chromium is absent and cannot be installed here (not root, no apt-get, no network)."""


def chromium() -> str:
    """The chromium binary, installed by the tests' one apt installer when it is missing."""
    try:
        tools.ensure("chromium")
    except tools.MissingProgram as e:
        raise MissingBrowser(str(e)) from None
    return shutil.which("chromium") or "chromium"


@dataclass
class Loaded:
    dom: str              # the DOM after parsing, as chromium serialises it
    console: list[str]    # every console message chromium logged (errors, CSP violations)
    png: bytes            # a screenshot of the viewport


def load(binary: str, page: Path, width: int = 1000, height: int = 1400) -> Loaded:
    """Open ``page`` twice in a fresh profile: once for the DOM, once for a screenshot."""
    console, out = [], {}
    with tempfile.TemporaryDirectory(prefix="ddp-smoke-chromium-") as tmp:
        shot = Path(tmp) / "shot.png"
        for mode in (["--dump-dom"], [f"--screenshot={shot}", f"--window-size={width},{height}"]):
            done = subprocess.run([binary, *FLAGS, f"--user-data-dir={tmp}/profile-{len(out)}",
                                   *mode, page.resolve().as_uri()], capture_output=True,
                                  text=True, timeout=LOAD_TIMEOUT_S)
            console += [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
            out[mode[0]] = done
        dom = out["--dump-dom"].stdout
        assert "<html" in dom, f"no DOM from chromium: {out['--dump-dom'].stderr[-2000:]}"
        assert shot.exists(), f"no screenshot: {out[mode[0]].stderr[-2000:]}"
        return Loaded(dom, console, shot.read_bytes())


def pixel_variance(data: bytes) -> float:
    """Variance of the grey level of a PNG: 0 for a blank (one-colour) image."""
    from PIL import Image, ImageStat  # pillow: the test extra's

    with Image.open(io.BytesIO(data)) as image:
        return ImageStat.Stat(image.convert("L")).var[0]
