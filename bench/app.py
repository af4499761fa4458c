"""The app as a visitor meets it: real server, Debian's Chromium, every page, memory from /proc.

``python -m bench.app`` starts ``streamlit run streamlit_app.py`` (as the README) on 127.0.0.1 with the hosted memory budget
(``KDA_LAB_MEMORY_MIB``, default 690: Streamlit Community Cloud's documented floor), drives Chromium
(Playwright, the system binary; never ``playwright install``) through Home and every tab, and per
page records the first render time, the rerun time of each of up to 3 widget changes (slider/select-slider
steps by keyboard), console errors, error alerts and tracebacks, and the server tree's RSS/PSS after the
page (server + all descendants, ``/proc/*/smaps_rollup``; a sampler thread every 0.1 s gives the peak).
Then it checks the lingering processes and the final memory, opens three heavy pages at once (all must
finish), and opens three deep links at once on a second, fresh server (every session must show the
sectioned navigation). Writes ``bench/results/app.json``.

Order: the server is started, and Home is opened at once by a fresh browser (``home_first_render_fresh_s``:
the first visitor after a wake-up, from the moment the server listens; the browser has nothing cached).
The tour then runs on that same server and browser: a warm server, as every later visitor meets it.
Home's defaults are cached by then (``st.cache_data``, shared by visitors), so the tour also opens Home
with non-default settings by deep link (``home_uncached_warm_s``: Home's own work on a warm server).
Last, on the same warm server, every page's deep link is opened by a new visitor: a fresh browser context each
(no HTTP cache, no cookies: the frontend's scripts, Plotly's included, load again), timed as a first render
(``new_session_first_render_s`` per page: a new browser session's first page on a warm server).

First render, measured: from the ``page.goto`` call (a deep link: the whole frontend loads, as for a
visitor with a link) until the browser last saw the script go idle (``data-test-script-state`` turns
``notRunning``) or a Plotly chart finish drawing (its ``.main-svg``), whichever is later; a new session's charts
mount only once Plotly's lazily loaded chunk is in, often after the script went idle, and are waited for. A
MutationObserver installed before the page loads stamps these events with the browser's clock
(``performance.timeOrigin + performance.now()``, the same wall clock as the bench). The bench then waits
until the page is idle, 300 ms more, and idle again (a rerun that follows the first run is waited for
and counted, since its idle is the later one); that settle wait confirms the end and is not counted.
Widget reruns are timed from the key press until idle again, settle wait included (an upper bound).

Goals (hosted: about 1 GB per app, 690 MiB documented floor): PSS at the end <= 500 MiB, peak
<= 690 MiB; first render at defaults <= 2 s per page on a warm server (in the tour, and for a new session),
Home <= 4 s on a fresh one.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import threading
import time
from pathlib import Path

from app_pages.registry import HOME, SECTIONS, TABS
from bench.app_server import (
    CHROMIUM,
    FLAGS,
    IDLE,
    open_deep_links_together,
    sectioned_navigation_problems,
    streamlit_server,
    tree_cpu_s,
    tree_memory,
)

RESULTS = Path(__file__).resolve().parent / "results" / "app.json"
README = Path(__file__).resolve().parent / "README.md"
GOALS = {"end_pss_mib": 500, "peak_pss_mib": 690, "home_first_render_s": 4.0, "page_first_render_s": 2.0,
         "new_session_first_render_s": 2.0}
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


# Installed before every document loads: stamps each change of the script state and of the number of
# drawn Plotly charts with the wall clock (ms since the epoch); read back by _first_render_s.
TIMELINE = """
window.__kdaTimeline = [];
new MutationObserver(() => {
  const app = document.querySelector("[data-testid='stApp']");
  const state = app ? app.getAttribute('data-test-script-state') : null;
  const drawn = document.querySelectorAll("[data-testid='stPlotlyChart'] .main-svg").length;
  if (state !== window.__kdaState || drawn !== window.__kdaDrawn) {
    window.__kdaState = state; window.__kdaDrawn = drawn;
    window.__kdaTimeline.push([performance.timeOrigin + performance.now(), state, drawn]);
  }
}).observe(document, {subtree: true, childList: true, attributes: true, attributeFilter: ['data-test-script-state']});
"""


def _first_render_s(page, t0_epoch_s: float) -> float:
    """Seconds from ``t0_epoch_s`` (wall clock at the goto call) until the browser last saw the script
    turn idle or a chart finish drawing (the page is idle when this is called: see the module doc)."""
    timeline = page.evaluate("window.__kdaTimeline")
    idle = [t for t, state, _ in timeline if state == "notRunning"]
    if not idle:
        raise RuntimeError(f"the browser never saw the script idle: {timeline[-5:]}")
    drawn = [t for (t, _, n), (_, _, before) in zip(timeline[1:], timeline) if n != before]
    return max([idle[-1], *drawn]) / 1e3 - t0_epoch_s


# True once no element waits for its lazily loaded frontend chunk (Streamlit shows an ``stSkeleton`` meanwhile: a new
# session's first Plotly chart mounts only once Plotly's 4.7 MB chunk is in, which can end after the script went
# idle) and every Plotly chart on the page has drawn (its ``.main-svg``)
ALL_DRAWN = """() => !document.querySelector("[data-testid='stMain'] [data-testid='stSkeleton']") &&
  [...document.querySelectorAll("[data-testid='stPlotlyChart']")].every(c => c.querySelector('.main-svg'))"""


def _wait_idle(page, timeout_ms: int = 600_000) -> None:
    """Wait until the script is idle (twice, 300 ms apart: a rerun may follow the first run at once), no element
    waits for its frontend chunk and every chart has drawn (:data:`ALL_DRAWN`)."""
    page.wait_for_selector(IDLE, timeout=timeout_ms)
    page.wait_for_timeout(300)                    # a rerun may follow the first run immediately
    page.wait_for_selector(IDLE, timeout=timeout_ms)
    page.wait_for_function(ALL_DRAWN, timeout=120_000, polling=50)


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


def open_timed(page, url: str, path: str, t0: float | None = None) -> float:
    """Open ``url + path`` (a deep link), wait until idle; return the first render time (module doc) from ``t0``
    (wall clock, s since the epoch; default now)."""
    t0 = time.time() if t0 is None else t0
    page.goto(url + path, wait_until="domcontentloaded", timeout=120_000)   # a loaded host: 30 s is not enough
    _wait_idle(page)
    return _first_render_s(page, t0)


HOME_UNCACHED = "/?p00_new=2"   # Home with a setting neither its default nor set by the tour: not cached


def render_phases(page, t0_epoch_s: float) -> dict:
    """A first render's parts, from the browser's timeline (s since ``t0_epoch_s``): ``frontend_s`` until the script
    starts (the frontend's scripts, the websocket, the session), ``script_s`` while it runs (as the browser sees it:
    the script and the drawing of what it sends), ``after_idle_s`` from idle to the last chart drawn (lazily loaded
    chunks, Plotly's above all); they add up to the first render."""
    stamps = [(t / 1e3 - t0_epoch_s, state) for t, state, _ in page.evaluate("window.__kdaTimeline")]
    running = [t for t, state in stamps if state == "running"]
    idle = next(t for t, state in stamps if state == "notRunning" and t >= running[-1])   # the last run's end
    end = _first_render_s(page, t0_epoch_s)
    return dict(frontend_s=round(running[0], 2), script_s=round(idle - running[0], 2),
                after_idle_s=round(end - idle, 2))


def _client_cpu_s() -> float:
    """CPU seconds used so far by this process's descendants: Chromium's processes and Playwright's driver (which
    only relays commands; this process's own polling is left out)."""
    return tree_cpu_s(os.getpid()) - time.process_time()


def new_sessions(browser, url: str, server_pid: int) -> tuple[dict, dict]:
    """Each page's deep link opened by a new visitor on the warm server: a fresh browser context per page (no HTTP
    cache). Returns ``{page title: first render s}`` (module doc) and ``{page title: split}``: the first render's
    phases (:func:`render_phases`), the CPU seconds of the browser (``browser_cpu_s``: :func:`_client_cpu_s`) and of
    the server tree over the visit (``server_cpu_s``: the script run, the static files, the
    websocket), which depend on the load much less than the wall clock."""
    out, split = {}, {}
    for tab in [HOME] + TABS:
        ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = ctx.new_page()
        page.add_init_script(TIMELINE)
        cpu0, client0 = tree_cpu_s(server_pid), _client_cpu_s()
        t0 = time.time()
        out[tab.title] = round(open_timed(page, url, "/" if tab is HOME else "/" + tab.url_path, t0), 2)
        split[tab.title] = dict(render_phases(page, t0), browser_cpu_s=round(_client_cpu_s() - client0, 2),
                                server_cpu_s=round(tree_cpu_s(server_pid) - cpu0, 2))
        ctx.close()
        print(f"{tab.title:36s} new session {out[tab.title]:6.2f} s  {split[tab.title]}  load {os.getloadavg()[0]:.2f}",
              flush=True)
    return out, split


def tour(env: dict) -> tuple[dict, contextlib.ExitStack, str, int]:
    """Start the server; open Home at once in a fresh browser (the first visitor after a wake-up), then
    visit Home and every tab on that warm server, change widgets, and open Home uncached. Return the
    records and memory, and the still-running server (its ExitStack, url and pid)."""
    from playwright.sync_api import sync_playwright

    p = sync_playwright().start()
    browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)   # ready before the server
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.add_init_script(TIMELINE)
    rows, console = [], []
    page.on("console", lambda m: console.append(f"{m.text} {m.location.get('url', '')}")
            if m.type == "error" and not IGNORED.search(f"{m.text} {m.location.get('url', '')}") else None)
    server = contextlib.ExitStack()
    try:
        url, pid = server.enter_context(streamlit_server(env=env))
        sampler = PeakSampler(pid)
        sampler.start()
        fresh = open_timed(page, url, "/")
        fresh_console = list(console)
        print(f"{'Home on a fresh server':36s} first {fresh:6.2f} s", flush=True)
        for tab in [HOME] + TABS:
            n_console = len(console)
            first = open_timed(page, url, "/" if tab is HOME else "/" + tab.url_path)
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
        uncached = open_timed(page, url, HOME_UNCACHED)
        print(f"{'Home uncached (' + HOME_UNCACHED + ')':36s} first {uncached:6.2f} s", flush=True)
        load_new = os.getloadavg()[0]
        fresh_visitors, fresh_split = new_sessions(browser, url, pid)
        browser.close()
        p.stop()
    except BaseException:
        server.close()
        raise
    time.sleep(2.0)
    end = tree_memory(pid)
    sampler.stop()
    return dict(pages=rows, home_first_render_fresh_s=round(fresh, 2), home_fresh_console_errors=fresh_console,
                home_uncached_warm_s=round(uncached, 2),
                home_uncached_path=HOME_UNCACHED, new_session_first_render_s=fresh_visitors,
                new_session_split=fresh_split,
                new_session_load_average_1m=[round(load_new, 2), round(os.getloadavg()[0], 2)], peak_pss_mib=round(sampler.peak_pss_mib),
                max_processes=sampler.max_processes, end_rss_mib=round(end.rss_mib), end_pss_mib=round(end.pss_mib),
                end_processes=end.processes, widget_changes=sum(len(r["rerun_s"]) for r in rows)), server, url, pid


def write_readme_section(name: str, body: str, readme: Path = README) -> None:
    """Replace the text of section ``## <name>`` of ``readme`` (up to the next ``## `` heading) with ``body``.
    Raises ValueError if the section is missing."""
    text = readme.read_text()
    head = f"## {name}\n"
    if head not in text:
        raise ValueError(f"{readme} has no section {head.strip()!r}")
    before, rest = text.split(head, 1)
    after = rest[rest.index("\n## "):] if "\n## " in rest else "\n"
    readme.write_text(before + head + "\n" + body.strip() + "\n" + after)


def readme_section(result: dict) -> str:
    """bench/README.md's ``app.json`` section for ``result`` (the command, what it measures, the latest run)."""
    pages = result["pages"]
    goal = GOALS["page_first_render_s"]
    titles = [r["page"] for r in pages]
    short = ["Home" if t == HOME.title else t.split()[0] for t in titles]
    new = result["new_session_first_render_s"]
    over = lambda xs: [s for s, x in zip(short, xs) if x > goal]   # noqa: E731
    row = lambda xs: "| " + " | ".join(f"{x:.2f}" for x in xs) + " |"   # noqa: E731
    tour, fresh = [r["first_render_s"] for r in pages], [new[t] for t in titles]
    lb, la = result["load_average_before"], result["load_average_after"]
    parts = {"frontend_s": "until the script starts", "script_s": "script running", "after_idle_s": "idle → charts drawn",
             "browser_cpu_s": "browser CPU s", "server_cpu_s": "server CPU s"}
    split_rows = "\n".join(f"| {name} {row([result['new_session_split'][t][k] for t in titles])}"
                           for k, name in parts.items())
    return f"""`python -m bench.app` (`--memory-mib 690`: the hosted budget, Streamlit Community Cloud's documented floor) starts
`streamlit run streamlit_app.py` on 127.0.0.1, drives Debian's Chromium through Home and every tab, and records per page the
first render (from navigation until the script is idle or a chart has drawn), the rerun time of up to 3 widget
changes (settle wait included: an upper bound), console errors and the server tree's RSS / PSS; then every page's
deep link opened by a new visitor (a fresh browser context: no HTTP cache) on the same warm server; then three heavy
pages at once and three simultaneous deep links on a fresh server. Goals: PSS ≤ 500 MiB at the end, ≤ 690 MiB
peak, Home ≤ 4 s on a fresh server, each page ≤ 2 s on a warm one (in the tour and for a new session). This
section is written by the command.

Latest run ({result['cores']} cores, load average {lb[0]:.1f} / {lb[1]:.1f} / {lb[2]:.1f} (1 / 5 / 15 min) before, {la[0]:.1f} / {la[1]:.1f} / {la[2]:.1f} after; new sessions at 1-minute load {result['new_session_load_average_1m'][0]:.1f} → {result['new_session_load_average_1m'][1]:.1f}): PSS {result['end_pss_mib']} MiB at the end (goal ≤ {GOALS['end_pss_mib']}), peak {result['peak_pss_mib']} MiB (goal ≤ {GOALS['peak_pss_mib']}); {result['widget_changes']} widget changes; concurrent heavy pages: {'; '.join(result['concurrent_heavy_pages_problems']) or 'no problem'}; deep-link race: {'; '.join(result['deep_link_race_problems']) or 'no problem'}; {sum(r['error_alerts'] + r['tracebacks'] for r in pages)} error alerts, {sum(len(r['console_errors']) for r in pages) + len(result['home_fresh_console_errors'])} console errors. **Home on a fresh server {result['home_first_render_fresh_s']:.2f} s** (goal ≤ {GOALS['home_first_render_s']:g} s); Home off its defaults on the warm server {result['home_uncached_warm_s']:.2f} s. First render per page on the warm server, in the tour (same browser) and **for a new session** (s; over {goal:g} s: tour {', '.join(over(tour)) or 'none'}; new session {', '.join(over(fresh)) or 'none'}):

| | {' | '.join(short)} |
|---|{'---|' * len(short)}
| tour {row(tour)}
| new session {row(fresh)}
{split_rows}
A new session's first render in parts (s): until the script starts (the frontend's ~100 scripts, the websocket, the
session), while it runs (as the browser sees it), and after it went idle until the last chart drew (the lazily loaded
chunks: Plotly's is 4.7 MB); then the CPU seconds the visit cost the browser (Chromium's processes) and the server
(script run, static files, websocket), which depend on the load much less than the wall clock does.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory-mib", type=float, default=690.0, help="KDA_LAB_MEMORY_MIB for the server (hosted budget)")
    args = ap.parse_args(argv)
    env = {"KDA_LAB_MEMORY_MIB": f"{args.memory_mib:g}"}
    load_before = os.getloadavg()
    result, server, url, pid = tour(env)
    with server:
        heavy = open_deep_links_together(url, ["/kcp", "/raw_input_ring", "/verify_and_replay"])
        result["concurrent_heavy_pages_problems"] = sectioned_navigation_problems(
            heavy, SECTIONS, [HOME.title] + [t.title for t in TABS])
        result["pss_after_concurrent_mib"] = round(tree_memory(pid).pss_mib)
    with streamlit_server(env=env) as (url, _pid):
        views = open_deep_links_together(url, ["/fleet_hashing", "/prefix_anatomy", "/page_pool"])
    race = sectioned_navigation_problems(views, SECTIONS, [HOME.title] + [t.title for t in TABS])
    result.update(deep_link_race_problems=race,
                  memory_budget_mib=args.memory_mib, goals=GOALS, cores=os.cpu_count(),
                  load_average_before=[round(x, 2) for x in load_before],
                  load_average_after=[round(x, 2) for x in os.getloadavg()])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    write_readme_section(RESULTS.name, readme_section(result))
    print(f"\n{'page':36s} {'first s':>8s} {'reruns s':>20s} {'PSS MiB':>8s} {'alerts':>6s} {'console':>7s}")
    for r in result["pages"]:
        print(f"{r['page']:36s} {r['first_render_s']:8.2f} {str(r['rerun_s']):>20s} {r['pss_mib']:8d} "
              f"{r['error_alerts'] + r['tracebacks']:6d} {len(r['console_errors']):7d}")
    new = result["new_session_first_render_s"]
    print(f"\nnew session on the warm server: {min(new.values()):.2f}-{max(new.values()):.2f} s per page, "
          f"{sum(v <= GOALS['new_session_first_render_s'] for v in new.values())} of {len(new)} within "
          f"{GOALS['new_session_first_render_s']} s (load average {result['new_session_load_average_1m']})")
    print(f"Home on a fresh server: {result['home_first_render_fresh_s']:.2f} s (goal <= "
          f"{GOALS['home_first_render_s']} s); Home uncached on the warm server: {result['home_uncached_warm_s']:.2f} s")
    print(f"PSS at the end {result['end_pss_mib']} MiB (goal <= {GOALS['end_pss_mib']}), peak {result['peak_pss_mib']} MiB "
          f"(goal <= {GOALS['peak_pss_mib']}), {result['widget_changes']} widget changes, "
          f"{result['end_processes']} process(es) left")
    print(f"concurrent deep links: {'OK' if not race else race}; three heavy pages at once: "
          f"{result['concurrent_heavy_pages_problems'] or 'OK'} (PSS after {result['pss_after_concurrent_mib']} MiB)")
    print(f"load average before/after: {result['load_average_before']} / {result['load_average_after']}; wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
