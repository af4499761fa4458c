"""bench.peers' machinery: the parsers of llama.cpp's two benchmarks on recorded output of a real run
(``tests/data/``: ``llama-bench -p 128,1024 -n 0 -t 1,2 -r 3 -fa off -o json`` and ``llama-batched-bench -c 4096
-npp 32 -ntg 32 -npl 1,8,32,64 -t 1 -ctk f32 -ctv f32 -fa off --output-format jsonl`` on the shipped weights'
GGUF), the model's FLOP count, the README sections, and the run itself at tiny sizes (ours always; llama.cpp and
transformers when they are there, skipped with the reason otherwise)."""
import json
from pathlib import Path

import pytest

from bench.peer_engines import (
    HF,
    LlamaCpp,
    cached_gguf,
    llama_cpp_missing,
    parse_batched_bench,
    parse_llama_bench,
)
from bench.peers import (
    FOLDER,
    ModelFlops,
    Size,
    bench_readme_section,
    model_flops,
    readme_section,
    run,
)
from bench.readme import replace_section
from lab.peers import peers_table, verdicts

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
TINY = Size(prefill=(16,), batches=(1, 2), hf_prefill=(16,), hf_batches=(1,), steps=2, hf_steps=2, ntg=4,
            threads=(1,), repeats=5)


def test_parse_llama_bench_recorded_output():
    got = parse_llama_bench((DATA / "llama_bench.json").read_text())
    assert got == {(128, 1): 4196.546647, (1024, 1): 4681.414581, (128, 2): 8424.016004, (1024, 2): 8137.605746}


def test_parse_llama_bench_rejects_other_output():
    with pytest.raises(ValueError, match="not llama-bench JSON"):
        parse_llama_bench("| model | size |\n|---|---|")          # the markdown default, not -o json
    with pytest.raises(ValueError, match="not llama-bench JSON"):
        parse_llama_bench('[{"n_prompt": 128}]')


def test_parse_batched_bench_recorded_output():
    text = "main: n_kv_max = 16384\n" + (DATA / "llama_batched_bench.jsonl").read_text()   # a log line is skipped
    got = parse_batched_bench(text)
    assert got == {(1, 1): 1715.173828, (8, 1): 2212.791016, (32, 1): 1863.139282, (64, 1): 2242.911133}
    first = json.loads((DATA / "llama_batched_bench.jsonl").read_text().splitlines()[0])
    assert first["speed_tg"] == pytest.approx(first["pl"] * first["tg"] / first["t_tg"], rel=1e-3)  # B x ntg / t


def test_parse_batched_bench_rejects_other_output():
    with pytest.raises(ValueError, match="no llama-batched-bench result"):
        parse_batched_bench("|    PP |     TG |    B |")
    with pytest.raises(ValueError, match="not llama-batched-bench jsonl"):
        parse_batched_bench('{"pl": 1}')


def test_model_flops_of_the_shipped_weights():
    """Counted by hand from config.json: active weights per layer, D = 128. KDA attention: q, k, v, o 4 D^2 =
    65,536, beta 4 D = 512, decay and output gates 4 x 32 D = 16,384, convs 3 x 4 D = 1,536: 83,968. Layer 0's dense
    MLP 3 x 512 D = 196,608. MoE: shared 3 D^2 = 49,152, router 8 D = 1,024, 2 of 8 experts 6 D^2 = 98,304: 148,480.
    MLA: q 192 D, kv_a 80 D, kv_b 256 x 64, o D^2: 67,584. Layers 1, 2, 4, 5, 6 KDA + MoE, 3 and 7 MLA + MoE, lm_head
    256 D: 280,576 + 5 x 232,448 + 2 x 216,064 + 32,768 = 1,907,712 weights, 2 FLOPs each."""
    assert model_flops(FOLDER) == ModelFlops(2 * 1_907_712, 6 * 7 * 4 * 32 * 32, 2 * 2 * 4 * (32 + 16 + 32))
    assert ModelFlops(10, 5, 2).per_token(3.5) == 22


def test_replace_section_replaces_or_inserts():
    text = "# t\n\n## a.json\n\nold\n\n## b.json\n\nkeep\n"
    assert replace_section(text, "## a.json", "## a.json\n\nnew\n", "## b.json") == \
        "# t\n\n## a.json\n\nnew\n\n## b.json\n\nkeep\n"
    assert replace_section("# t\n\n## b.json\n", "## a.json", "## a.json\n\nnew\n", "## b.json") == \
        "# t\n\n## a.json\n\nnew\n\n## b.json\n"
    assert replace_section("# t\n\n## b.json\n\nx\n", "## b.json", "## b.json\n\ny\n", "## z") == "# t\n\n## b.json\n\ny\n"
    with pytest.raises(ValueError, match="neither"):
        replace_section("# t\n", "## a.json", "## a.json\n", "## b.json")


def test_readme_sections_are_regenerated_from_the_committed_results():
    """The README's performance table and bench/README.md's section are what `python -m bench.peers --readme`
    writes from the committed file, not typed by hand."""
    result = json.loads((REPO / "bench" / "results" / "peers.json").read_text())
    assert readme_section(result) in (REPO / "README.md").read_text()
    assert bench_readme_section(result) in (REPO / "bench" / "README.md").read_text()


def test_run_ours_at_tiny_sizes():
    result = run(TINY, ("ours",), progress=lambda _: None)
    assert [(r["measure"], r["size"], r["threads"]) for r in result["rows"]] == \
        [("prefill", 16, 1), ("decode", 1, 1), ("decode", 2, 1)]
    for row in result["rows"]:
        assert row["ours"]["min"] > 0 and len(row["ours"]["samples"]) == 5
        assert row["llama.cpp"] is None and row["transformers"] is None
    assert result["matmul_gflops"]["1"]["median"] > 0 and result["load_avg_1m"]["before"] >= 0
    table = peers_table(result)
    assert list(table["ours ÷ llama.cpp"]) == ["—"] * 3
    assert {v.status for v in verdicts(result)} == {"not run"}


def test_run_says_how_to_build_llama_cpp_when_it_is_not(tmp_path):
    result = run(TINY._replace(prefill=(), batches=()), ("llama.cpp",), cache=tmp_path, progress=lambda _: None)
    (note,) = [n for n in result["notes"] if n.startswith("llama.cpp not run")]
    assert "python -m bench.llama_cpp build" in note and "llama-bench" in note


@pytest.fixture(scope="module")
def llama():
    missing = llama_cpp_missing()
    if missing is not None:
        pytest.skip(missing)
    return LlamaCpp(cached_gguf(FOLDER))


def test_llama_cpp_at_tiny_sizes(llama):
    assert set(llama.prefill((16,), (1,))) == {(16, 1)}
    decode = llama.decode((1, 2), 1, 4)
    assert set(decode) == {(1, 1), (2, 1)} and min(decode.values()) > 0


def test_transformers_at_tiny_sizes():
    pytest.importorskip("transformers")
    try:
        hf = HF(FOLDER)
    except ImportError as err:
        pytest.skip(f"transformers without KimiLinearForCausalLM: {err}")
    assert hf.prefill(16, 1) > 0
    assert hf.decode(2, 1, 2) > 0


def test_llama_cpp_decode_runs_again_when_a_batch_line_is_missing(monkeypatch):
    """llama-batched-bench sometimes exits 0 without a batch's line: that run is repeated, never reported short."""
    line = ('{{"pl": {pl}, "n_threads": 1, "speed_tg": 100.0}}')
    outputs = iter([line.format(pl=1), line.format(pl=1) + "\n" + line.format(pl=2)])
    monkeypatch.setattr(LlamaCpp, "_run", staticmethod(lambda cmd: next(outputs)))
    eng = LlamaCpp.__new__(LlamaCpp)
    monkeypatch.setattr(LlamaCpp, "decode_cmd", lambda self, *a: ["llama-batched-bench"])
    assert set(eng.decode((1, 2), 1, 4)) == {(1, 1), (2, 1)}
    outputs = iter([line.format(pl=1)] * 3)
    with pytest.raises(RuntimeError, match=r"no result for batches \[2\] in 3 runs"):
        eng.decode((1, 2), 1, 4)
