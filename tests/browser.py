"""A headless browser for the router report's page (Utils/router_report.html): Debian's chromium, which setup.sh
installs as root; the tests that need it skip without it."""
import os
import re
import shutil
import subprocess
import tempfile

import pytest

CHROMIUM = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(name)), None)
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here to open the page in: `apt-get install "
                                                            "chromium` (setup.sh installs it when run as root)")


def chromium(*args) -> subprocess.CompletedProcess:
    """Headless Chromium with `args`, a fresh profile (nothing of an earlier run)."""
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                               f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=120)


def page_dom(path, address=""):
    """A page's DOM after its scripts ran: (body's data-rendered marker or None, the #errors text, the DOM)."""
    out = chromium("--dump-dom", f"file://{os.path.abspath(path)}{address}").stdout
    rendered = re.search(r'<body[^>]*data-rendered="([^"]*)"', out)
    return rendered and rendered[1], re.search(r'<pre id="errors">(.*?)</pre>', out, re.S)[1], out
