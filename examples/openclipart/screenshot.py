"""The demo README's picture of `vlprep view`: the page of a dataset, opened in headless chromium, saved as a PNG.

    .venv/bin/vlprep view demo-out/openclipart/bow --out demo-out/openclipart/bow-view
    .venv/bin/python examples/openclipart/screenshot.py demo-out/openclipart/bow-view/index.html \
        examples/openclipart/view-bow.png

Needs Debian's chromium and chromium-driver (scripts/apt-deps.sh) and selenium (the [test] extra).
"""

import argparse
import io
import os
import tempfile
from pathlib import Path

from PIL import Image


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page", type=Path, help="a `vlprep view` index.html")
    ap.add_argument("png", type=Path, help="the screenshot to write (256 colours, to keep the repository small)")
    ap.add_argument("--size", default="1280,900", help="window width,height in CSS pixels (default 1280,900)")
    args = ap.parse_args()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={args.size}"):
        options.add_argument(arg)
    # chromium leaves its singleton socket's folder in TMPDIR after quitting: a temporary one, removed after
    with tempfile.TemporaryDirectory() as tmp:
        service = Service("/usr/bin/chromedriver", env={**os.environ, "TMPDIR": tmp})
        driver = webdriver.Chrome(service=service, options=options)
        try:
            driver.get(args.page.resolve().as_uri())
            # every thumbnail on screen loaded before the picture is taken
            WebDriverWait(driver, 30).until(lambda d: d.execute_script(
                "return [...document.images].every(i => i.complete && i.naturalWidth > 0)"))
            png = driver.get_screenshot_as_png()
        finally:
            driver.quit()
    Image.open(io.BytesIO(png)).convert("RGB").quantize(256).save(args.png, optimize=True)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
