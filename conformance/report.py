"""What a run of the suite reports: each check's :class:`CheckResult` (pass / fail / not applicable, its parts,
the evidence and the public sources of the bug it guards against), the whole :class:`Report` as JSON and as a
readable table."""
from __future__ import annotations

import enum
import json
import textwrap
from dataclasses import asdict, dataclass, field


class Status(enum.StrEnum):
    """A check's or a part's outcome. ``NA``: the engine cannot be put in the state the check needs (a setting it
    lacks, a metric it does not expose) or the run could not make the check meaningful; the reason says which."""

    PASS = "pass"
    FAIL = "fail"
    NA = "n/a"


class Source(tuple):
    """A public thread a check cites: ``(label, url)`` (a GitHub issue or pull request)."""

    def __new__(cls, label: str, url: str):
        return super().__new__(cls, (label, url))

    @property
    def label(self) -> str:
        return self[0]

    @property
    def url(self) -> str:
        return self[1]


@dataclass
class Part:
    """One comparison inside a check: ``name``, ``status``, a one-line ``summary`` and its ``evidence`` (plain
    JSON-able values: the first differing token, max |delta logprob|, counters)."""

    name: str
    status: Status
    summary: str
    evidence: dict = field(default_factory=dict)
    premise: bool = False        # a condition that makes the check meaningful: n/a here makes the check n/a


@dataclass
class CheckResult:
    """One check: ``id``, ``title``, the ``invariant`` it asserts, the ``bug`` class it comes from, ``sources``,
    its ``parts`` and the overall ``status``: FAIL if any part failed, else NA if a premise part is n/a (the run
    could not exercise what the check is about: no prefix hit, no draft), else PASS if any part passed, else NA."""

    id: str
    title: str
    invariant: str
    bug: str
    sources: tuple
    parts: list

    @property
    def status(self) -> Status:
        statuses = {p.status for p in self.parts}
        if Status.FAIL in statuses:
            return Status.FAIL
        if any(p.premise and p.status is Status.NA for p in self.parts):
            return Status.NA
        return Status.PASS if Status.PASS in statuses else Status.NA

    @property
    def summary(self) -> str:
        """The first failing part's summary; else an unmet premise's; else the other parts' summaries, the
        comparisons (parts whose evidence has ``positions_compared``) counted with their largest |delta logprob|,
        then the parts that were not applicable, by name."""
        failing = [p for p in self.parts if p.status is Status.FAIL]
        if failing:
            return failing[0].summary
        unmet = [p for p in self.parts if p.premise and p.status is Status.NA]
        if unmet:
            return unmet[0].summary
        compared = [p for p in self.parts if "positions_compared" in p.evidence and p.status is Status.PASS
                    and not p.premise]
        skipped = [p for p in self.parts if p.status is Status.NA]
        out = [p.summary for p in self.parts if p not in compared and p not in skipped]
        if len(compared) == 1:
            out.append(compared[0].summary)
        elif compared:
            dl = [p.evidence["max_abs_dlogprob"] for p in compared if p.evidence.get("max_abs_dlogprob") is not None]
            out.append(f"{len(compared)} comparisons equal" + (f", max |dlogprob| {max(dl):.1e}" if dl else ""))
        out += [f"{p.name}: {p.summary}" for p in skipped]
        return "; ".join(out) or "no part ran"

    def to_json(self) -> dict:
        return {"id": self.id, "title": self.title, "status": self.status.value, "summary": self.summary,
                "invariant": self.invariant, "bug": self.bug,
                "sources": [{"label": s.label, "url": s.url} for s in self.sources],
                "parts": [dict(asdict(p), status=p.status.value) for p in self.parts]}


@dataclass
class Report:
    """A run: ``engine`` (adapter name), ``target`` (how it was reached: the URL or the launch command),
    ``settings`` (the options and variants used), ``results`` (one :class:`CheckResult` per check run)."""

    engine: str
    target: str
    settings: dict
    results: list

    @property
    def failed(self) -> bool:
        return any(r.status is Status.FAIL for r in self.results)

    def to_json(self) -> dict:
        counts = {s.value: sum(r.status is s for r in self.results) for s in Status}
        return {"engine": self.engine, "target": self.target, "settings": self.settings, "counts": counts,
                "checks": [r.to_json() for r in self.results]}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, ensure_ascii=False)

    def table(self, width: int = 110) -> str:
        """The readable form: one row per check (status, id, summary), then each part with its evidence and the
        sources."""
        lines = [f"KDA conformance: {self.engine} at {self.target}", ""]
        if self.settings.get("adapter_run_here") is False:
            lines[1:1] = [f"note: the {self.engine} adapter is written from its docs and code and has not been run "
                          "against it here; check its flags first", ""]
        lines.append(f"{'status':<7} {'check':<20} summary")
        lines.append("-" * width)
        for r in self.results:
            first, *rest = textwrap.wrap(r.summary, width - 29) or [""]
            lines.append(f"{r.status.value:<7} {r.id:<20} {first}")
            lines += [" " * 29 + more for more in rest]
        for r in self.results:
            lines += ["", f"[{r.status.value}] {r.id}: {r.title}", f"  invariant: {r.invariant}",
                      f"  bug class: {r.bug}"]
            for p in r.parts:
                lines += textwrap.wrap(f"{p.status.value:>4}  {p.name}: {p.summary}", width,
                                       initial_indent="  ", subsequent_indent="        ")
            lines.append("  sources: " + "; ".join(f"{s.label} <{s.url}>" for s in r.sources))
        counts = self.to_json()["counts"]
        lines += ["", f"{counts['pass']} passed, {counts['fail']} failed, {counts['n/a']} not applicable"]
        return "\n".join(lines)
