"""A screenshot tour of every tab in Chromium: each page at its defaults and at two widget extremes, for review by eye.

``python -m bench.screens --out /tmp/screens`` starts ``streamlit run app.py`` (``bench.app_server``), opens every tab
of ``app_pages.registry`` three times and saves a full-length PNG of each view:

- ``NN_<name>_default.png``: the page as a visitor first sees it;
- ``NN_<name>_low.png``: every declared URL parameter at its low end (numbers at ``min_value``, a choice's first
  option, a range's two lowest options, toggles off);
- ``NN_<name>_high.png``: every parameter at its high end (numbers at ``max_value``, a choice's last option, a range
  over all options, toggles on).

The parameters are the page's own declaration (its ``declare(...)`` call, read from the file, see
:func:`declared_params`), carried in the URL as a deep link. Buttons that start a measurement on request are
clicked (``--no-click`` leaves them), so the sections behind them are in the shot too. ``summary.json`` lists, per
view, the seconds it took, any exception or error alert, each metric label or value the browser shows cut (an
element whose text is wider than its box), each data grid wider than its box (columns cut at the right), and each
chart's drawn problems (:data:`PLOT_CHECK`: points outside the axis range; a legend or annotation over the plot, the
tick labels or the data labels; an unlabelled log axis). Screenshots go to ``--out`` only, never into the repository.
Needs Chromium at ``/usr/bin/chromium`` and the ``playwright`` package (no browser download).
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from pathlib import Path
from urllib.parse import urlencode

from app_pages.params import Choice, Float, Int, Multi, Param, Range, Text, Toggle
from app_pages.registry import HOME, TABS, Tab
from bench.app_server import CHROMIUM, FLAGS, IDLE, REPO, streamlit_server

VIEWS = ("default", "low", "high")
RUN_BUTTON = "[data-testid='stBaseButton-primary']"     # run_on_request's button (app_pages.measurement)
FULL_MAX_PX = 16_000                                    # cap on a full-length shot's height
# An element whose text is wider than its box is shown cut (ellipsis, clipped or behind a scroll bar): metric labels,
# values and deltas (page 08's "cold − warm 13.9 ms (paired IQR 1…"), code blocks (Home's warm output).
CUT_TEXT = """() => Array.from(document.querySelectorAll(
    "[data-testid='stMetricLabel'] p, [data-testid='stMetricLabel'] div, [data-testid='stMetricValue'] div, "
    + "[data-testid='stMetricDelta'] div, [data-testid='stMetricDelta'] span, [data-testid='stCode'] pre"))
    .filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.innerText.slice(0, 80))"""
# A data grid (st.dataframe) wider than its box: the columns on the right are cut until the visitor scrolls.
WIDE_TABLES = """() => Array.from(document.querySelectorAll("[data-testid='stDataFrame']")).map((t, i) => {
    const s = t.querySelector('.dvn-scroller');
    if (!s || s.scrollWidth <= s.clientWidth + 1) return null;
    return (t.closest('[class*="st-key-"]')?.className.match(/st-key-([\\w-]+)/) || [])[1] || `table ${i + 1}`;
  }).filter(Boolean)"""
# Each Plotly chart as drawn (its key, from the element's id): plotted points outside their axis's range (a numeric
# x / y of a scatter, bar or box trace, log axes compared in log10), a legend over a plot area or over the axes'
# tick labels or titles, an annotation over a legend, a tick label or a data label, data labels over each other, a
# plot area under 35 % of its chart's height (a long legend ate it), and a log axis with fewer than two labels.
PLOT_CHECK = """() => {
  const box = e => e.getBoundingClientRect();
  const hit = (a, b) => a.width > 0 && b.width > 0 && a.left < b.right - 1 && b.left < a.right - 1
                        && a.top < b.bottom - 1 && b.top < a.bottom - 1;
  const out = [];
  document.querySelectorAll("[data-testid='stPlotlyChart']").forEach(chart => {
    const gd = chart.querySelector('.js-plotly-plot');
    if (!gd || !gd._fullLayout) return;
    const key = (chart.closest('[class*="st-key-"]')?.className.match(/st-key-([\\w-]+)/) || [])[1] || '?';
    const fl = gd._fullLayout, problems = [];
    (gd._fullData || []).forEach(t => {
      if (t.visible !== true || !['scatter', 'bar', 'box'].includes(t.type)) return;
      ['x', 'y'].forEach(letter => {
        const ax = fl[(t[letter + 'axis'] || letter).replace(/^([xy])/, '$1axis')];
        if (!ax || !['linear', 'log'].includes(ax.type) || !Array.isArray(ax.range)) return;
        if (t.type === 'bar' && letter === (t.orientation === 'h' ? 'y' : 'x')) return;
        const vals = Array.from(t[letter] || []).filter(v => v !== null && v !== undefined && v !== '')
                          .map(Number).filter(v => Number.isFinite(v)                         // null: a gap
                                                                      && (ax.type !== 'log' || v > 0));
        const [lo, hi] = [Math.min(...ax.range), Math.max(...ax.range)];
        const bad = vals.filter(v => { const u = ax.type === 'log' ? Math.log10(v) : v;
                                      return u < lo - 1e-9 * Math.abs(lo) || u > hi + 1e-9 * Math.abs(hi); });
        if (bad.length) problems.push(`${t.name || t.type}: ${bad.length} ${letter} outside ${ax._name} ` +
                                      `[${ax.type === 'log' ? [10 ** lo, 10 ** hi].map(v => v.toPrecision(3)) : [lo, hi]}]`);
      });
    });
    Object.keys(fl).filter(k => /^[xy]axis\\d*$/.test(k) && fl[k].type === 'log' && fl[k].visible).forEach(k => {
      const labels = gd.querySelectorAll(`.${k.replace('axis', '')}tick text`);
      if (labels.length < 2) problems.push(`${k}: log axis with ${labels.length} label(s)`);
    });
    const legend = gd.querySelector('.legend'), plots = Array.from(gd.querySelectorAll('.nsewdrag'));
    const tall = plots.reduce((h, p) => h + box(p).height, 0);      // a legend or margins eating the chart
    if (plots.length && tall < 0.35 * box(gd).height) problems.push(`plot area ${Math.round(tall)} px of `
                                                                 + `${Math.round(box(gd).height)} px`);
    const labels = Array.from(gd.querySelectorAll('[class$="tick"] text, [class^="g-x"][class$="title"] text, '
                                                  + '[class^="g-y"][class$="title"] text, .gtitle'));
    if (legend) {
      const lb = box(legend.querySelector('.bg') || legend);
      if (plots.some(p => hit(lb, box(p)))) problems.push('legend over the plot area');
      const over = labels.filter(l => hit(lb, box(l))).map(l => l.textContent);
      if (over.length) problems.push(`legend over ${over.slice(0, 3).join(' | ')}`);
    }
    const marks = Array.from(gd.querySelectorAll('.bartext, .textpoint')).filter(t => box(t).width > 0);
    const clash = marks.filter((t, i) => marks.some((u, j) => j > i && hit(box(t), box(u))));
    if (clash.length) problems.push(`${clash.length} data labels over each other (${clash[0].textContent})`);
    gd.querySelectorAll('.annotation').forEach(a => {
      const ab = box(a), txt = a.textContent.slice(0, 40);
      if (legend && hit(ab, box(legend.querySelector('.bg') || legend))) problems.push(`annotation "${txt}" over the legend`);
      const over = labels.concat(marks).filter(l => hit(ab, box(l))).map(l => l.textContent);
      if (over.length) problems.push(`annotation "${txt}" over ${over.slice(0, 3).join(' | ')}`);
    });
    if (problems.length) out.push({chart: key, problems});
  });
  return out;
}"""


def declared_params(path: Path) -> list[Param]:
    """The parameters a page declares: the arguments of its ``declare(...)`` call, evaluated after the file's imports
    and the simple top-level assignments above the call (the page itself is not run). Returns [] for a page with
    no ``declare`` call; raises whatever evaluating the call raises (a declaration that needs the page's run)."""
    tree = ast.parse(path.read_text())
    namespace: dict = {}
    for node in tree.body:
        call = _declare_call(node)
        if call is not None:
            args = ast.fix_missing_locations(ast.Expression(ast.Tuple(elts=call.args, ctx=ast.Load())))
            return list(eval(compile(args, str(path), "eval"), namespace))   # noqa: S307 (repo file)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            exec(compile(ast.Module([node], []), str(path), "exec"), namespace)               # noqa: S102
        elif isinstance(node, (ast.Assign, ast.FunctionDef)):
            try:
                exec(compile(ast.Module([node], []), str(path), "exec"), namespace)           # noqa: S102
            except Exception:   # an assignment that needs the page's run (st.columns): not part of the declaration
                pass
    return []


def _declare_call(node: ast.stmt) -> ast.Call | None:
    value = node.value if isinstance(node, (ast.Assign, ast.Expr)) else None
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "declare":
        return value
    return None


def extreme(param: Param, end: str):
    """``param``'s value at ``end`` ("low" or "high"), or None to leave it at its default (text)."""
    low = end == "low"
    if isinstance(param, (Int, Float)):
        return param.min_value if low else param.max_value
    if isinstance(param, Range):
        return tuple(param.options[:2]) if low else (param.options[0], param.options[-1])
    if isinstance(param, Multi):
        return [param.options[0]] if low else list(param.options)
    if isinstance(param, Choice):
        return param.options[0] if low else param.options[-1]
    if isinstance(param, Toggle):
        return not low
    if isinstance(param, Text):
        return None
    raise TypeError(f"{param.key}: no extreme for a {type(param).__name__}")


def view_query(params: list[Param], view: str) -> str:
    """The query string (with ``?``, or empty) that opens a page at ``view``."""
    if view == "default":
        return ""
    pairs = [(p.key, text) for p in params if (v := extreme(p, view)) is not None for text in p.format(v)]
    return "?" + urlencode(pairs) if pairs else ""


def _settle(page, timeout_ms: int) -> None:
    for _ in range(2):                     # a rerun may start right after the first idle state
        page.wait_for_selector(IDLE, timeout=timeout_ms)
        page.wait_for_timeout(800)


def full_length_screenshot(page, path: Path) -> None:
    """The whole page: Streamlit scrolls inside its main container, so the viewport is stretched to the content's
    height (capped at ``FULL_MAX_PX``) for the shot, then restored."""
    size = page.viewport_size
    height = page.evaluate("""() => Math.max(...Array.from(document.querySelectorAll(
        "[data-testid='stMain'], [data-testid='stAppViewContainer'], [data-testid='stMainBlockContainer']"))
        .map(e => e.scrollHeight), document.body.scrollHeight)""")
    page.set_viewport_size({"width": size["width"], "height": min(FULL_MAX_PX, max(size["height"], int(height)))})
    page.wait_for_timeout(1000)            # charts re-layout to the taller window
    page.screenshot(path=str(path))
    page.set_viewport_size(size)


def visit(page, url: str, shot: Path, click: bool, timeout_ms: int) -> dict:
    """Open ``url``, click the measurement buttons (``click``), save the full-length shot; what the view showed."""
    t0 = time.perf_counter()
    page.goto(url, wait_until="domcontentloaded")
    _settle(page, timeout_ms)
    clicked = 0
    while click and clicked < 6 and page.locator(RUN_BUTTON).count():
        page.locator(RUN_BUTTON).first.click()
        clicked += 1
        _settle(page, timeout_ms)
    if page.locator("[data-testid='stPlotlyChart']").count():
        page.wait_for_selector("[data-testid='stPlotlyChart'] .main-svg", timeout=60_000)
    full_length_screenshot(page, shot)
    alerts = page.locator("[data-testid='stException'], [data-testid='stAlertContentError']")
    return {"url": url, "shot": shot.name, "seconds": round(time.perf_counter() - t0, 1), "clicked": clicked,
            "errors": [alerts.nth(i).inner_text()[:300] for i in range(alerts.count())],
            "cut_text": page.evaluate(CUT_TEXT), "wide_tables": page.evaluate(WIDE_TABLES),
            "charts": page.evaluate(PLOT_CHECK)}


def tour(out: Path, tabs: list[Tab], views: list[str], click: bool, width: int, timeout_s: float) -> list[dict]:
    """Every view of every tab in ``tabs``, screenshots in ``out``; the list of what each view showed."""
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with streamlit_server() as (url, _pid), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = browser.new_page(viewport={"width": width, "height": 1000})
        for tab in tabs:
            params = declared_params(REPO / tab.path)
            for view in views:
                stem = Path(tab.path).stem
                link = f"{url}/{'' if tab is HOME else tab.url_path}{view_query(params, view)}"
                try:
                    row = visit(page, link, out / f"{stem}_{view}.png", click, int(timeout_s * 1000))
                except Exception as exc:      # a view that times out is reported, the tour goes on
                    row = {"url": link, "shot": None, "errors": [f"{type(exc).__name__}: {exc}"[:300]]}
                rows.append({"page": stem, "view": view, **row})
                print(f"{stem:32s} {view:8s} {row.get('seconds', '-')!s:>6} s  errors {len(row['errors'])}  "
                      f"cut {row.get('cut_text', [])}  wide {row.get('wide_tables', [])}  "
                      f"charts {row.get('charts', [])}", flush=True)
        browser.close()
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the PNGs and summary.json (not the repo)")
    ap.add_argument("--pages", default="", help="page numbers to visit, comma-separated (00,03,17); default all")
    ap.add_argument("--views", default=",".join(VIEWS), help=f"comma-separated, of {', '.join(VIEWS)}")
    ap.add_argument("--no-click", action="store_true", help="leave the run-on-request buttons unclicked")
    ap.add_argument("--width", type=int, default=1400, help="browser window width in px")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="longest wait for one page to finish running")
    args = ap.parse_args(argv)
    if args.out.resolve().is_relative_to(REPO):
        ap.error(f"--out {args.out} is inside the repository; screenshots are never committed")
    wanted = {n.strip() for n in args.pages.split(",") if n.strip()}
    tabs = [t for t in [HOME, *TABS] if not wanted or Path(t.path).stem[:2] in wanted]
    views = [v.strip() for v in args.views.split(",")]
    if not tabs or not set(views) <= set(VIEWS):
        ap.error(f"no page among {args.pages!r}, or a view not among {VIEWS}")
    rows = tour(args.out, tabs, views, not args.no_click, args.width, args.timeout_s)
    bad = [r for r in rows if r["errors"] or r.get("cut_text") or r.get("wide_tables") or r.get("charts")]
    print(f"{len(rows)} views, {len(bad)} with an error, cut text, a wide table or a chart problem; shots in {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
