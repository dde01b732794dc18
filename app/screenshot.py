"""The README's screenshot (assets/screenshot.png): `python -m app.screenshot CACHE_DIR OUT.png` starts `squeeze serve`
on CACHE_DIR, uploads assets/passkey.pdf in Debian's chromium (Playwright, the test extra), waits for it to be
prepared, asks for the passkey and captures the page once the views are drawn. Minutes on a CPU (the embedded model
is converted into CACHE_DIR first unless it holds it already)."""

from __future__ import annotations

import argparse
import re
import subprocess
import time

PORT = 7871
CHROMIUM = "/usr/bin/chromium"


def main() -> None:
    from playwright.sync_api import expect, sync_playwright

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("cache_dir")
    parser.add_argument("out")
    args = parser.parse_args()
    server = subprocess.Popen(["squeeze", "serve", "--cache-dir", args.cache_dir, "--port", str(PORT)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--headless=new"])
            page = browser.new_page(viewport={"width": 1500, "height": 1050})
            for _ in range(600):  # the server starts
                try:
                    page.goto(f"http://127.0.0.1:{PORT}")
                    break
                except Exception:  # noqa: BLE001 - not listening yet
                    time.sleep(1)
            page.locator("#sq-upload input[type=file]").set_input_files("assets/passkey.pdf")
            expect(page.locator("#sq-upload")).to_contain_text(re.compile(r"passkey\s*\.pdf"), timeout=60_000)
            expect(page.locator("#sq-upload td.download a").first).to_be_visible(timeout=60_000)  # uploaded
            page.click("#sq-prepare")
            expect(page.locator("#sq-doc-status")).to_contain_text("passkey.pdf: ready", timeout=900_000)
            page.locator("#sq-question textarea").fill("What is the secret passkey?")
            page.click("#sq-ask")
            page.wait_for_function("() => { const el = document.querySelector('#sq-view-heatmap .js-plotly-plot');"
                                   " return el && el.data && el.data.some(t => t.type === 'heatmap'); }",
                                   timeout=300_000)
            time.sleep(1)
            page.screenshot(path=args.out)
            browser.close()
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
