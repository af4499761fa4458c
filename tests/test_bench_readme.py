"""bench/README.md covers every shipped result: each ``bench/results/<name>.json`` has its section, named by the
file, with the command that regenerates it, and the summary table lists it; and no section names a file that is
not there. (The drafter table's figures are checked against the file in tests/lab/test_drafters.py.)"""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "bench" / "README.md"


def _sections() -> dict[str, str]:
    """``## <name>.json`` heading -> the section's text."""
    parts = re.split(r"^## (\S+\.json)\n", README.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_result_file_has_its_section_and_command():
    results = sorted(p.name for p in (REPO / "bench" / "results").glob("*.json"))
    sections = _sections()
    assert sorted(sections) == results
    table = README.read_text().split("\n## ", 1)[0]
    for name in results:
        module = {"state_precision_sr.json": "state_precision", "llama_cpp_agreement.json": "llama_cpp"}.get(
            name, name.removesuffix(".json"))
        assert (REPO / "bench" / f"{module}.py").is_file(), module
        assert f"`python -m bench.{module}" in sections[name], f"{name}: no `python -m bench.{module}` command"
        assert f"| `{name}` | `python -m bench.{module}" in table, f"{name} is not in the summary table"


def test_generated_sections_match_their_results_files():
    """The sections a bench command writes are what its writer makes of the committed results file now: nobody
    edited their figures by hand, and the file was not regenerated without them."""
    import json

    from bench import decode_step, kimi_agreement, peers

    def result(name):
        return json.loads((REPO / "bench" / "results" / name).read_text())
    assert _sections()["decode_step.json"].strip() == decode_step.readme_section(result("decode_step.json")).strip()
    assert _sections()["peers.json"].strip() == peers.bench_readme_section(result("peers.json")).split("\n", 1)[1].strip()
    top = (REPO / "README.md").read_text()
    assert peers.readme_section(result("peers.json")).strip() in top
    assert kimi_agreement.readme_section(result("llama_cpp_agreement.json")).strip() in top
