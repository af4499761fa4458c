"""A real ``streamlit run streamlit_app.py`` server (the served entry point) for ``bench.app`` and the browser tests,
its memory, and the concurrent deep-link check.

- ``streamlit_server()``: start the server on 127.0.0.1 (free port), yield ``(url, pid)``, stop it.
- ``tree_cpu_s(pid)``: CPU seconds used so far by the server plus its live descendants (``/proc/*/stat``).
- ``tree_memory(pid)``: RSS and PSS of the server plus all its descendants, in MiB, from
  ``/proc/<pid>/smaps_rollup`` (PSS shares each shared page among the processes mapping it, so
  the sum over a process tree is what the tree costs the host; Streamlit Community Cloud limits a
  container's memory, which is the tree).
- ``open_deep_links_together(url, paths)``: open several deep links in separate browser contexts
  at the same moment (a hosted app waking from sleep) and return what each session shows.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
IDLE = "[data-testid='stApp'][data-test-script-state='notRunning']"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def streamlit_server(timeout_s: float = 60.0, env: dict | None = None, script: str = "streamlit_app.py"):
    """Start ``streamlit run <script>`` (default the served entry point, as the README runs it) from the repository
    root; yield ``(url, pid)``.

    Raises RuntimeError if the server exits or does not listen within ``timeout_s`` seconds."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", script, "--server.headless", "true",
         "--server.address", "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats", "false"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        deadline = time.time() + timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError as exc:
                if proc.poll() is not None:
                    raise RuntimeError(f"streamlit exited: {proc.stdout.read().decode()[-2000:]}") from exc
                if time.time() > deadline:
                    raise RuntimeError(f"streamlit did not listen within {timeout_s:.0f} s") from exc
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            kids += [int(c) for c in (task / "children").read_text().split()]
    return kids


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


class TreeMemory(NamedTuple):
    rss_mib: float      # resident set, summed (double-counts shared pages)
    pss_mib: float      # proportional set, summed (shared pages split among their mappers)
    processes: int      # server + descendants alive at the sample


def tree_memory(pid: int) -> TreeMemory:
    """RSS and PSS (MiB) of ``pid`` and all its descendants, from ``/proc/*/smaps_rollup``."""
    rss = pss = 0
    n = 0
    for p in _descendants(pid):
        try:
            text = Path(f"/proc/{p}/smaps_rollup").read_text()
        except OSError:
            continue                      # exited between listing and reading
        n += 1
        for line in text.splitlines():
            if line.startswith("Rss:"):
                rss += int(line.split()[1])
            elif line.startswith("Pss:"):
                pss += int(line.split()[1])
    return TreeMemory(rss / 1024, pss / 1024, n)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its live descendants, from ``/proc/*/stat``."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in _descendants(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue                      # exited between listing and reading
        total += int(fields[11]) + int(fields[12])       # utime, stime: fields 14 and 15 of proc(5)
    return total / ticks


class SessionView(NamedTuple):
    path: str            # the deep link opened, e.g. "/kcp"
    nav: str             # text of the sidebar navigation
    exceptions: list     # text of every stException element
    title: str           # the first h1


async def _open_all(url: str, paths: list[str], timeout_ms: int) -> list[SessionView]:
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        pages = [await (await browser.new_context(viewport={"width": 1400, "height": 1000})).new_page()
                 for _ in paths]

        async def one(page, path):
            await page.goto(url + path, wait_until="domcontentloaded")
            await page.wait_for_selector(IDLE, timeout=timeout_ms)
            await page.wait_for_timeout(1500)        # a rerun may start right after the first run
            await page.wait_for_selector(IDLE, timeout=timeout_ms)
            nav = page.locator("[data-testid='stSidebarNav']")
            nav_text = await nav.inner_text(timeout=30_000) if await nav.count() else ""
            exc = page.locator("[data-testid='stException']")
            excs = [await exc.nth(i).inner_text() for i in range(await exc.count())]
            h1 = page.locator("h1")
            title = await h1.first.inner_text() if await h1.count() else ""
            return SessionView(path, nav_text, excs, title)

        views = await asyncio.gather(*(one(pg, path) for pg, path in zip(pages, paths)))
        await browser.close()
        return list(views)


def open_deep_links_together(url: str, paths: list[str], timeout_ms: int = 240_000) -> list[SessionView]:
    """Open every path of ``paths`` (e.g. ``["/kcp", "/prefix_miss", "/"]``) in its own browser
    context at the same moment; return one ``SessionView`` per path once each session is idle."""
    return asyncio.run(_open_all(url, paths, timeout_ms))


def sectioned_navigation_problems(views: list[SessionView], sections: list[str], tab_titles: list[str]) -> list[str]:
    """What is wrong with each session's view: not ``st.navigation``'s sectioned list (every section
    and tab title, no ``app``/``common``/``registry`` entries), a traceback, or no title."""
    problems = []
    for v in views:
        missing = [s for s in sections + tab_titles if s not in v.nav]
        if missing:
            problems.append(f"{v.path}: navigation lacks {missing[:4]}: {v.nav[:200]!r}")
        legacy = [w for w in ("common", "registry") if w in v.nav.lower()]
        if legacy:
            problems.append(f"{v.path}: navigation lists legacy entries {legacy}")
        if v.exceptions:
            problems.append(f"{v.path}: traceback: {v.exceptions[0][:300]}")
        if not v.title:
            problems.append(f"{v.path}: no title rendered")
    return problems
