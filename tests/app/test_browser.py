"""Real-browser test: Playwright drives Debian's Chromium against ``streamlit run app.py``.

Visits every page in the navigation, waits until the script has finished and the charts are drawn,
fails on any ``stException`` element, any metric label or value shown cut (``bench.screens.CUT_TEXT``), any
``st.error`` alert (``stAlertContentError``; only the texts
allow-listed in tests/app/allowed_errors.py pass) or browser console error (ignoring only the offline 404s for
fonts and ``_stcore/health``/``host-config``), and saves a screenshot of each page (the README's
screenshot is the home page's) and a full-length one (``<page>_full.png``, to review every table and chart).
Skips when Chromium is missing, unless ``REQUIRE_BROWSER=1``.
"""
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app_pages.registry import HOME, SECTIONS, TABS
from bench.screens import CUT_TEXT, full_length_screenshot
from tests.app.allowed_errors import allowed

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
SHOTS = REPO / "tests" / "app" / "screenshots"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ERROR_ALERT = "[data-testid='stAlertContentError']"  # st.error in Streamlit 1.67 (ErrorElement: stAlertContent{Kind})
# Pages whose verdict is an st.success: the alert must be there with this text (tests/app/verdicts.py
# checks the rest of each verdict in the AppTest sweep).
SUCCESS = {HOME.path: "Outputs identical to the cache-off run", "app_pages/02_verify_and_replay.py": "Bitwise equal"}
# Every toast's text as it is shown, kept after it closes: a toast lasts 4 s, and a page that computes longer after
# its links are checked (page 05 on a loaded machine) is still running when the toast has gone.
TOAST_RECORDER = """window.__toasts = [];
new MutationObserver(() => document.querySelectorAll("[data-testid='stToast']").forEach(t => {
    if (t.innerText && !window.__toasts.includes(t.innerText)) window.__toasts.push(t.innerText);
})).observe(document, {childList: true, subtree: true, characterData: true});"""
IGNORED = re.compile(r"(fonts|\.woff2?|_stcore/health|_stcore/host-config|favicon)", re.I)

pytestmark = pytest.mark.browser


def _require_browser():
    if not (os.path.exists(CHROMIUM) and shutil.which(CHROMIUM)):
        if os.environ.get("REQUIRE_BROWSER") == "1":
            pytest.fail(f"REQUIRE_BROWSER=1 but no Chromium at {CHROMIUM} (apt-get install chromium)")
        pytest.skip(f"no Chromium at {CHROMIUM}; install Debian's chromium to run the browser test")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        if os.environ.get("REQUIRE_BROWSER") == "1":
            pytest.fail("REQUIRE_BROWSER=1 but the playwright package is missing (pip install -r requirements-dev.txt)")
        pytest.skip("playwright is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    _require_browser()
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app.py", "--server.headless", "true",
         "--server.address", "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats", "false"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"streamlit exited: {proc.stdout.read().decode()[-2000:]}")
            time.sleep(0.3)
    else:
        proc.kill()
        pytest.fail("streamlit did not start within 60 s")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def _error_alerts(page, path: str) -> list[str]:
    """The st.error alerts on the page that are not allow-listed for ``path`` (an stException is
    reported on its own, not again here)."""
    texts = [a.inner_text() for a in page.locator(ERROR_ALERT).all()
             if not a.locator("xpath=ancestor::*[@data-testid='stException']").count()]
    return [f"{path}: st.error: {t[:500]}" for t in texts if allowed(path, t.strip()) is None]


def test_every_page_in_browser(server):
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    errors = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})

        def on_console(msg):
            if msg.type == "error" and not IGNORED.search(msg.text + " " + str(msg.location.get("url", ""))):
                errors.append(f"{page.url}: console error: {msg.text}")

        page.on("console", on_console)
        page.on("pageerror", lambda exc: errors.append(f"{page.url}: page error: {exc}"))
        # A deep link as the very first request of a fresh server must still get st.navigation's
        # sidebar (sections, registered tabs only), not an auto-discovered list of files.
        first = TABS[-1]
        page.goto(server + "/" + first.url_path, wait_until="domcontentloaded")
        page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']", timeout=180_000)
        page.wait_for_timeout(1000)
        page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']", timeout=180_000)
        nav = page.locator("[data-testid='stSidebarNav']").inner_text(timeout=30_000)
        for want in [first.title, TABS[0].title, "Parallel & fleet"]:
            assert want in nav, f"deep link first: sidebar lacks {want!r}: {nav!r}"
        for unwanted in ("common", "registry"):
            assert unwanted not in nav.lower(), f"deep link first: sidebar lists {unwanted!r}: {nav!r}"
        for tab in [HOME] + TABS:
            url = server + ("/" if tab is HOME else "/" + tab.url_path)
            page.goto(url, wait_until="domcontentloaded")
            page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']", timeout=180_000)
            page.wait_for_timeout(500)
            page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']", timeout=180_000)
            if page.locator("[data-testid='stPlotlyChart']").count():
                page.wait_for_selector("[data-testid='stPlotlyChart'] .main-svg", timeout=60_000)
            exc = page.locator("[data-testid='stException']")
            if exc.count():
                errors.append(f"{tab.path}: stException: {exc.first.inner_text()[:500]}")
            errors += _error_alerts(page, tab.path)
            cut = page.evaluate(CUT_TEXT)             # a metric label or value wider than its box: shown cut
            if cut:
                errors.append(f"{tab.path}: metric text cut off: {cut}")
            if tab.path in SUCCESS:
                shown = [a.inner_text() for a in page.locator("[data-testid='stAlertContentSuccess']").all()]
                if not any(t.strip().startswith(SUCCESS[tab.path]) for t in shown):
                    errors.append(f"{tab.path}: no success alert {SUCCESS[tab.path]!r}; shown: {shown}")
            title = page.locator("h1").first.inner_text(timeout=10_000) if page.locator("h1").count() else ""
            assert title, f"{tab.path}: no title rendered"
            page.screenshot(path=str(SHOTS / f"{Path(tab.path).stem}.png"), full_page=True)
            full_length_screenshot(page, SHOTS / f"{Path(tab.path).stem}_full.png")
        browser.close()
    assert not errors, "\n".join(errors)


def _settle(page) -> None:
    for _ in range(2):    # a rerun may start right after the first idle state
        page.wait_for_selector("[data-testid='stApp'][data-test-script-state='notRunning']", timeout=180_000)
        page.wait_for_timeout(700)


@pytest.mark.parametrize(("link", "bound", "key"), [
    ("raw_input_ring?p04_capacity=8&p04_window=4", "p04_capacity", "p04_window"),
    ("verify_and_replay?p02_mode=injected+deviation&p02_draft=8&p02_corrupt_at=7", "p02_draft", "p02_corrupt_at"),
])
def test_a_dependent_slider_hidden_then_shown_under_a_lower_bound_follows_it(server, link, bound, key):
    """Regression: a dependent slider hidden for a run (page 04 at one ring slot, page 02 at one draft) came back
    with the value Streamlit kept for it, above its new max, and the page showed StreamlitValueAboveMaxError
    ("the value 4 is greater than the max_value 3"). AppTest does not keep hidden widgets' values: browser only."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{server}/{link}", wait_until="domcontentloaded")
        _settle(page)
        thumb = page.locator(f".st-key-{bound} input[type='range']").first
        for keys in (["ArrowLeft"] * 7, ["ArrowRight"] * 2):     # down to 1 (the follower hides), then up to 3
            thumb.focus()
            for k in keys:
                page.keyboard.press(k)
            _settle(page)
        shown = page.locator(f".st-key-{key} input[type='range']").first
        exc = page.locator("[data-testid='stException']")
        problem = exc.first.inner_text()[:300] if exc.count() else None
        value, top = shown.evaluate("e => [e.value, e.max]") if shown.count() else (None, None)
        browser.close()
    assert problem is None, problem
    assert value is not None and int(value) <= int(top) == 3, (value, top)


@pytest.mark.parametrize(("link", "key", "default", "why"), [
    ("page_pool?p05_seed=inf", "p05_seed", "0", "not an integer"),
    ("fleet_hashing?p11_index=" + "9" * 25_000, "p11_index", "1", "outside [0, "),
    ("page_pool?p05_long_share=nan", "p05_long_share", "0.8", "not a finite number"),
], ids=["inf", "25000-digits", "nan"])
def test_a_bad_number_in_a_link_is_ignored_in_the_browser(server, link, key, default, why):
    """Regression: ``/page_pool?p05_seed=inf`` (and a 25,000-digit ``p11_index``) showed a stack trace from
    Streamlit's ``number_input`` deserializer while the page's toast said the value was ignored; ``nan`` was dropped
    with no notice. Now the toast names the value and why, the widget shows its default, and the address bar no
    longer carries the value."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.add_init_script(TOAST_RECORDER)
        page.goto(f"{server}/{link}", wait_until="domcontentloaded")
        page.wait_for_selector(f".st-key-{key}", timeout=180_000)   # the run reached the widget (toast before it):
        _settle(page)                                                # idle before the first run is not "settled"
        # The run being over is not the toast being drawn: the browser draws it only once Streamlit's lazily loaded
        # Toast chunk has come from the server, which on a loaded machine can be seconds after the run ended (a
        # 3 s late chunk made the idle wait alone miss the toast in 2 of 3 loads). Wait for the toast itself.
        with contextlib.suppress(PlaywrightTimeout):
            page.wait_for_function("key => window.__toasts.some(t => t.includes(`link's ${key}=`))", arg=key,
                                   timeout=60_000)
        exc = page.locator("[data-testid='stException']")
        problem = exc.first.inner_text()[:300] if exc.count() else None
        toasts = page.evaluate("() => window.__toasts")
        thumb = page.locator(f".st-key-{key} [role='slider']")
        value = (thumb.first.get_attribute("aria-valuenow") if thumb.count() else
                 page.locator(f".st-key-{key} input").first.input_value())
        url = page.url
        browser.close()
    assert problem is None, problem
    assert any(f"link's {key}=" in t and why in t and "it was ignored" in t for t in toasts), (toasts, value, url[-80:])
    assert float(value) == float(default), value
    assert f"{key}=" not in url, url[:200]


def test_back_and_forward_step_through_the_views(server):
    """A moved widget goes into the address bar (``app_pages.links`` writes ``st.query_params``); the
    browser's back and forward give the previous and next values back, and a page switch there and back keeps the
    value, its key off the other page's URL."""
    from playwright.sync_api import sync_playwright

    def groups(page) -> str:
        return page.locator(".st-key-p05_groups input[type='range']").first.evaluate("e => e.value")

    def step(page, url: str, value: str | None) -> tuple[str, str | None]:
        """Wait (on a loaded machine a rerun can start late) for the address bar and the slider, then read both."""
        with contextlib.suppress(PlaywrightTimeout):
            page.wait_for_url(server + url, timeout=60_000)
            _settle(page)
            if value is not None:
                page.wait_for_function("([sel, v]) => document.querySelector(sel)?.value === v",
                                       arg=[".st-key-p05_groups input[type='range']", value], timeout=60_000)
        return page.url, (groups(page) if value is not None else None)

    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    tab = {t.url_path: t for t in TABS}       # by path: a tab added to a section shifts the positions
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{server}/page_pool", wait_until="domcontentloaded")
        page.wait_for_selector(".st-key-p05_groups input[type='range']", timeout=180_000)
        _settle(page)
        for g in ("2", "3"):
            page.locator(".st-key-p05_groups input[type='range']").first.focus()
            page.keyboard.press("ArrowRight")
            seen = [step(page, f"/page_pool?p05_groups={g}", g)]
        page.go_back()
        seen.append(step(page, "/page_pool?p05_groups=2", "2"))
        page.go_forward()
        seen.append(step(page, "/page_pool?p05_groups=3", "3"))
        page.locator("[data-testid='stSidebarNav'] a", has_text=tab["fleet_hashing"].title).click()
        seen.append(step(page, "/fleet_hashing", None))
        page.locator("[data-testid='stSidebarNav'] a", has_text=tab["page_pool"].title).click()
        seen.append(step(page, "/page_pool?p05_groups=3", "3"))
        browser.close()
    tails = [(url.removeprefix(server), value) for url, value in seen]
    assert tails == [("/page_pool?p05_groups=3", "3"), ("/page_pool?p05_groups=2", "2"),
                     ("/page_pool?p05_groups=3", "3"), ("/fleet_hashing", None),
                     ("/page_pool?p05_groups=3", "3")], tails


def test_concurrent_deep_links_on_fresh_server():
    """Three different deep links opened at the same moment on a freshly started server (a hosted app
    waking from sleep): every session gets st.navigation's sectioned list and its page, none the
    auto-discovered list of files (``app``, ``common``, ``registry``) or an ImportError traceback."""
    _require_browser()
    from bench.app_server import open_deep_links_together, sectioned_navigation_problems, streamlit_server

    paths = ["/fleet_hashing", "/prefix_anatomy", "/page_pool"]       # three light pages, three sections
    assert set(paths) <= {"/" + t.url_path for t in TABS}
    with streamlit_server() as (url, _pid):
        views = open_deep_links_together(url, paths)
    problems = sectioned_navigation_problems(views, SECTIONS, [HOME.title] + [t.title for t in TABS])
    assert not problems, "\n".join(problems)
