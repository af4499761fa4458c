"""The app as a visitor meets it: real server, Debian's Chromium, every page, memory from /proc.

``python -m bench.app`` starts ``streamlit run app.py`` on 127.0.0.1 with the hosted memory budget
(``KDA_LAB_MEMORY_MIB``, default 690: Streamlit Community Cloud's documented floor), drives Chromium
(Playwright, the system binary; never ``playwright install``) through Home and every tab, and per
page records the first render time (navigation until the script is idle and the charts are drawn),
the rerun time of each of up to 3 widget changes (slider/select-slider steps by keyboard), console
errors, error alerts and tracebacks, and the server tree's RSS/PSS after the page (server + all
descendants, ``/proc/*/smaps_rollup``; a sampler thread every 0.1 s gives the peak). Then it checks
the lingering processes and the final memory, opens three heavy pages at once (all must finish),
and opens three deep links at once on a second, fresh server (every session must show the
sectioned navigation). Writes ``bench/results/app.json``.

Goals (hosted: about 1 GB per app, 690 MiB documented floor): PSS at the end <= 500 MiB, peak
<= 690 MiB; first render at defaults <= 2 s per page on a warm server, Home <= 4 s on a fresh one.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from pathlib import Path

from bench.app_server import (
    CHROMIUM,
    FLAGS,
    IDLE,
    open_deep_links_together,
    sectioned_navigation_problems,
    streamlit_server,
    tree_memory,
)
from pages._registry import HOME, SECTIONS, TABS

RESULTS = Path(__file__).resolve().parent / "results" / "app.json"
GOALS = {"end_pss_mib": 500, "peak_pss_mib": 690, "home_first_render_s": 4.0, "page_first_render_s": 2.0}
ERROR_ALERT = "[data-testid='stAlertContentError']"
IGNORED = re.compile(r"(fonts|\.woff2?|_stcore/health|_stcore/host-config|favicon)", re.I)   # offline, as the browser test


class PeakSampler(threading.Thread):
    """Samples the server tree's PSS every ``period_s`` seconds; ``peak_pss_mib`` is the maximum seen."""

    def __init__(self, pid: int, period_s: float = 0.1):
        super().__init__(daemon=True)
        self.pid, self.period_s, self.peak_pss_mib, self.max_processes = pid, period_s, 0.0, 0
        self._stop_event = threading.Event()

    def run(self):
        while not self._stop_event.is_set():
            m = tree_memory(self.pid)
            self.peak_pss_mib = max(self.peak_pss_mib, m.pss_mib)
            self.max_processes = max(self.max_processes, m.processes)
            time.sleep(self.period_s)

    def stop(self):
        self._stop_event.set()
        self.join()


def _url_path(path: str) -> str:
    stem = Path(path).stem
    return stem.split("_", 1)[1] if stem[:2].isdigit() else stem


def _wait_idle(page, timeout_ms: int = 600_000) -> None:
    page.wait_for_selector(IDLE, timeout=timeout_ms)
    page.wait_for_timeout(300)                    # a rerun may follow the first run immediately
    page.wait_for_selector(IDLE, timeout=timeout_ms)
    if page.locator("[data-testid='stPlotlyChart']").count():
        page.wait_for_selector("[data-testid='stPlotlyChart'] .main-svg", timeout=60_000)


def _change_widgets(page, max_changes: int = 3) -> list[float]:
    """Step up to ``max_changes`` sliders one notch by keyboard (ArrowRight, or ArrowLeft at the
    maximum) on the range input inside the thumb around ``stSliderThumbValue`` (react-aria); return
    each rerun's seconds (key press until the script is idle again); a slider that does not move is skipped."""
    times = []
    values = page.locator("[data-testid='stSlider'] [data-testid='stSliderThumbValue']")
    for i in range(min(max_changes, values.count())):
        value, thumb = values.nth(i), values.nth(i).locator("xpath=..").locator("input").first
        before = value.inner_text()
        thumb.focus()
        t0 = time.perf_counter()
        thumb.press("ArrowRight")
        page.wait_for_timeout(100)
        if value.inner_text() == before:                         # at its maximum: step down instead
            thumb.press("ArrowLeft")
            page.wait_for_timeout(100)
        if value.inner_text() == before:                         # disabled, or one of a range's thumbs pinned
            continue
        _wait_idle(page)
        times.append(time.perf_counter() - t0)
    return times


def tour(url: str, pid: int) -> dict:
    """Visit Home and every tab, change widgets, and return the per-page records and memory."""
    from playwright.sync_api import sync_playwright

    sampler = PeakSampler(pid)
    sampler.start()
    rows, console = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("console", lambda m: console.append(f"{m.text} {m.location.get('url', '')}")
                if m.type == "error" and not IGNORED.search(f"{m.text} {m.location.get('url', '')}") else None)
        for tab in [HOME] + TABS:
            n_console = len(console)
            t0 = time.perf_counter()
            page.goto(url + ("/" if tab is HOME else "/" + _url_path(tab.path)), wait_until="domcontentloaded")
            _wait_idle(page)
            first = time.perf_counter() - t0
            reruns = _change_widgets(page)
            mem = tree_memory(pid)
            rows.append(dict(page=tab.title, first_render_s=round(first, 2),
                             rerun_s=[round(x, 2) for x in reruns],
                             console_errors=console[n_console:],
                             error_alerts=page.locator(ERROR_ALERT).count(),
                             tracebacks=page.locator("[data-testid='stException']").count(),
                             rss_mib=round(mem.rss_mib), pss_mib=round(mem.pss_mib), processes=mem.processes))
            print(f"{tab.title:36s} first {first:6.2f} s  reruns {rows[-1]['rerun_s']}  PSS {mem.pss_mib:6.0f} MiB"
                  f"  procs {mem.processes}", flush=True)
        browser.close()
    time.sleep(2.0)
    end = tree_memory(pid)
    sampler.stop()
    return dict(pages=rows, peak_pss_mib=round(sampler.peak_pss_mib), max_processes=sampler.max_processes,
                end_rss_mib=round(end.rss_mib), end_pss_mib=round(end.pss_mib), end_processes=end.processes,
                widget_changes=sum(len(r["rerun_s"]) for r in rows))


def home_cold(env: dict) -> float:
    """Seconds until Home has rendered on a freshly started server (first visitor after a wake-up)."""
    from playwright.sync_api import sync_playwright

    with streamlit_server(env=env) as (url, _pid), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        t0 = time.perf_counter()
        page.goto(url + "/", wait_until="domcontentloaded")
        _wait_idle(page)
        seconds = time.perf_counter() - t0
        browser.close()
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory-mib", type=float, default=690.0, help="KDA_LAB_MEMORY_MIB for the server (hosted budget)")
    args = ap.parse_args(argv)
    env = {"KDA_LAB_MEMORY_MIB": f"{args.memory_mib:g}"}
    load_before = os.getloadavg()
    cold = home_cold(env)
    with streamlit_server(env=env) as (url, pid):
        result = tour(url, pid)
        heavy = open_deep_links_together(url, ["/kcp", "/raw_input_ring", "/verify_and_replay"])
        result["concurrent_heavy_pages_problems"] = sectioned_navigation_problems(
            heavy, SECTIONS, [HOME.title] + [t.title for t in TABS])
        result["pss_after_concurrent_mib"] = round(tree_memory(pid).pss_mib)
    with streamlit_server(env=env) as (url, _pid):
        views = open_deep_links_together(url, ["/fleet_hashing", "/prefix_anatomy", "/page_pool"])
    race = sectioned_navigation_problems(views, SECTIONS, [HOME.title] + [t.title for t in TABS])
    result.update(home_first_render_fresh_s=round(cold, 2), deep_link_race_problems=race,
                  memory_budget_mib=args.memory_mib, goals=GOALS, cores=os.cpu_count(),
                  load_average_before=[round(x, 2) for x in load_before],
                  load_average_after=[round(x, 2) for x in os.getloadavg()])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(f"\n{'page':36s} {'first s':>8s} {'reruns s':>20s} {'PSS MiB':>8s} {'alerts':>6s} {'console':>7s}")
    for r in result["pages"]:
        print(f"{r['page']:36s} {r['first_render_s']:8.2f} {str(r['rerun_s']):>20s} {r['pss_mib']:8d} "
              f"{r['error_alerts'] + r['tracebacks']:6d} {len(r['console_errors']):7d}")
    print(f"\nHome on a fresh server: {cold:.2f} s (goal <= {GOALS['home_first_render_s']} s)")
    print(f"PSS at the end {result['end_pss_mib']} MiB (goal <= {GOALS['end_pss_mib']}), peak {result['peak_pss_mib']} MiB "
          f"(goal <= {GOALS['peak_pss_mib']}), {result['widget_changes']} widget changes, "
          f"{result['end_processes']} process(es) left")
    print(f"concurrent deep links: {'OK' if not race else race}; three heavy pages at once: "
          f"{result['concurrent_heavy_pages_problems'] or 'OK'} (PSS after {result['pss_after_concurrent_mib']} MiB)")
    print(f"load average before/after: {result['load_average_before']} / {result['load_average_after']}; wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
