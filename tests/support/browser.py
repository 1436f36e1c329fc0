"""Headless chromium for the web UI tests (marker `browser`).

Playwright drives Debian's chromium package (`make test` installs it through
tests/support/install_browser.sh where it can): our machines cannot download
Playwright's own browser builds, so `playwright install` is never used.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import Browser

# The page size of the screenshots in docs/images and of every test page.
VIEWPORT = {"width": 1200, "height": 800}
# Set to 1 to rewrite docs/images/webui-*.png from the tests (tracked files:
# ordinary runs leave them alone).
SCREENSHOTS_ENV = "ROUNDHOUSE_UPDATE_SCREENSHOTS"
SCREENSHOTS_DIR = Path(__file__).resolve().parents[2] / "docs" / "images"


def find_chromium() -> tuple[str | None, str]:
    """Chromium's path, or None and why the browser tests cannot run."""
    try:
        import playwright  # noqa: F401
    except ImportError:
        return None, ("the playwright package is not installed "
                      "(pip install -e '.[test]' or make test)")
    override = os.environ.get("ROUNDHOUSE_CHROMIUM")
    if override:
        if os.access(override, os.X_OK):
            return override, ""
        return None, f"ROUNDHOUSE_CHROMIUM={override} is not an executable"
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path, ""
    return None, ("chromium is not installed (as root on Debian, make test installs it: "
                  "apt-get install chromium)")


@contextmanager
def launched_chromium(executable: str) -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # As root chromium refuses its sandbox; the pages are our own.
        browser = playwright.chromium.launch(executable_path=executable, headless=True,
                                             chromium_sandbox=False, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def update_screenshots() -> bool:
    return os.environ.get(SCREENSHOTS_ENV) == "1"
