"""guidellm (vllm-project/guidellm) against our server: ``python -m bench.guidellm --venv /tmp/glv``.

guidellm is not a dependency of this repository (its environment is ~6 GB); ``--venv`` names a virtual environment
where ``pip install guidellm`` was run (0.8.1 here). This script, run by the repository's Python:

1. builds a byte-level Hugging Face tokenizer in ``--tokenizer-dir`` with that venv's ``tokenizers`` /
   ``transformers`` (a BPE model with no merges over the 256 GPT-2 byte symbols, ByteLevel pre-tokenizer and
   decoder: id = byte value, 1 token per UTF-8 byte, as the server counts) and checks that ASCII and multi-byte
   prompts of N bytes encode to exactly their N bytes, so guidellm's token counts are the server's. No download:
   the machine is offline and guidellm accepts a local tokenizer directory;
2. per rate and repeat (rates interleaved), starts a fresh ``python -m serve.http`` on 127.0.0.1 (:func:`bench.serve_http.local_server`), sends
   one warm-up completion (not counted), then runs ``guidellm run`` with the openai_http backend on
   ``/v1/completions`` (streamed), a Poisson profile at that rate, ``--requests`` requests and synthetic text
   prompts of ``--prompt-tokens`` tokens asking for ``--output-tokens`` tokens, writing guidellm's JSON report;
3. keeps, per rate, the figures guidellm computed (TTFT, ITL, TPOT, request latency, request and output-token
   throughput; guidellm's own definitions) with the conditions (load average before / after, CPU count, versions)
   in ``bench/results/guidellm.json``. guidellm's full reports stay in ``--raw-dir``.

All figures are measured by guidellm, on this machine, in this run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "guidellm.json"
CHECK_TEXTS = ("hello world", "h\u00e9llo w\u00f6rld \u2713", "a  b\n\tc")   # 1-, 2- and 3-byte UTF-8 characters


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable character table (openai/gpt-2 ``src/encoder.py``), the alphabet of the
    ``tokenizers`` ByteLevel pre-tokenizer."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    return dict(zip(bs, map(chr, cs)))


def make_byte_tokenizer(out_dir: str) -> None:
    """Save the byte-level tokenizer (id = byte value, 256 ids) to ``out_dir`` and check it: every text of
    ``CHECK_TEXTS`` must encode to its UTF-8 bytes and decode back. Needs ``tokenizers`` and ``transformers``
    (run by the guidellm venv's Python). Raises AssertionError if a text does not count 1 token per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    b2u = byte_symbols()
    assert set(b2u.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1024).save_pretrained(out_dir)
    loaded = AutoTokenizer.from_pretrained(out_dir)
    for text in CHECK_TEXTS:
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert ids == list(text.encode()), f"{text!r}: {len(text.encode())} bytes -> {len(ids)} tokens {ids}"
        assert loaded.decode(ids) == text, f"{text!r} decodes to {loaded.decode(ids)!r}"


def summarize(report: dict) -> dict:
    """The per-rate row from guidellm's JSON report (one benchmark): its own statistics over successful
    requests, in guidellm's units (ms for TTFT / ITL / TPOT, s for request latency). Raises ValueError if the
    report does not hold exactly one benchmark."""
    if len(report.get("benchmarks", [])) != 1:
        raise ValueError(f"report: expected one benchmark, got {len(report.get('benchmarks', []))}")
    bench = report["benchmarks"][0]
    m = bench["metrics"]

    def stat(name: str, *keys: str) -> dict:
        s = m[name]["successful"]
        return {k: (s["percentiles"][k] if k.startswith("p") else s[k]) for k in keys}

    totals = m["request_totals"]
    strategy = bench["config"]["strategy"]
    return {"strategy": f"{strategy['type_']}@{strategy.get('rate')}",
            "requests_completed": totals["successful"], "requests_errored": totals["errored"],
            "requests_incomplete": totals["incomplete"], "duration_s": bench["duration"],
            "request_throughput_rps": m["requests_per_second"]["successful"]["mean"],
            "output_throughput_tps": m["output_tokens_per_second"]["successful"]["mean"],
            "prompt_tokens": stat("prompt_token_count", "mean", "min", "max"),
            "output_tokens": stat("output_token_count", "mean", "min", "max"),
            "ttft_ms": stat("time_to_first_token_ms", "mean", "median", "p95", "p99"),
            "itl_ms": stat("inter_token_latency_ms", "mean", "median", "p95", "p99"),
            "tpot_ms": stat("time_per_output_token_ms", "mean", "median", "p95", "p99"),
            "request_latency_s": stat("request_latency", "mean", "median", "p95", "p99")}


def run_rate(guidellm_bin: Path, url: str, model: str, tokenizer_dir: str, rate: float, requests: int,
             prompt_tokens: int, output_tokens: int, seed: int, report_path: Path) -> dict:
    """One ``guidellm run`` at ``rate`` req/s (Poisson); returns its JSON report. Raises RuntimeError with
    guidellm's output tail if it exits non-zero."""
    cmd = [str(guidellm_bin), "run",
           "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/completions",
           "--profile", f"kind=poisson,rate={rate}",
           "--constraint", f"kind=max_requests,count={requests}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
           "--seed", f"kind=static,value={seed}",
           "--output", f"kind=json,path={report_path}",
           "--disable-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print(proc.stdout[-6000:], flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"guidellm exited {proc.returncode}: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return json.loads(report_path.read_text())


def main(argv=None) -> list[dict]:
    import httpx

    from bench.serve_http import local_server

    p = argparse.ArgumentParser(prog="python -m bench.guidellm", description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", type=Path, default=Path("/tmp/glv"), help="virtual environment with guidellm")
    p.add_argument("--model", default="kda-demo")
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0], help="req/s (Poisson)")
    p.add_argument("--requests", type=int, default=30, help="requests per rate")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5, help="runs per rate, rates interleaved (1, 2, 1, 2, ...)")
    p.add_argument("--tokenizer-dir", default=None, help="where to build the byte tokenizer (default: a temp dir)")
    p.add_argument("--raw-dir", type=Path, default=Path(tempfile.gettempdir()) / "guidellm_reports")
    args = p.parse_args(argv)
    py, guidellm_bin = args.venv / "bin" / "python", args.venv / "bin" / "guidellm"
    for path in (py, guidellm_bin):
        if not path.exists():
            raise ValueError(f"--venv {args.venv}: {path} not found (pip install guidellm into that venv)")
    if args.prompt_tokens + args.output_tokens > args.max_model_len:
        raise ValueError(f"--prompt-tokens + --output-tokens must be <= --max-model-len {args.max_model_len}")
    tok_dir = args.tokenizer_dir or tempfile.mkdtemp(prefix="byte_tokenizer_")
    subprocess.run([str(py), __file__, "--make-tokenizer", tok_dir], check=True)
    version = subprocess.run([str(guidellm_bin), "--version"], capture_output=True, text=True).stdout.strip()
    args.raw_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for repeat, rate in ((r, rate) for r in range(args.repeats) for rate in args.rates):
        load_before = os.getloadavg()
        with local_server(args.max_model_len, args.max_num_seqs) as url:
            httpx.post(url + "/v1/completions", timeout=60,                              # warm-up, not counted
                       json={"model": args.model, "prompt": "x" * args.prompt_tokens, "max_tokens": 2})
            report = run_rate(guidellm_bin, url, args.model, tok_dir, rate, args.requests, args.prompt_tokens,
                              args.output_tokens, args.seed, args.raw_dir / f"guidellm_rate{rate:g}_{repeat}.json")
        row = {"rate_rps": rate, "repeat": repeat, **summarize(report), "load_avg_1_5_15_before": [round(x, 2) for x in load_before],
               "load_avg_1_5_15_after": [round(x, 2) for x in os.getloadavg()]}
        rows.append(row)
        print(f"repeat {repeat} rate {rate:g} req/s: {row['request_throughput_rps']:.2f} req/s, {row['output_throughput_tps']:.1f} "
              f"tok/s out, TTFT p50 {row['ttft_ms']['median']:.0f} / p99 {row['ttft_ms']['p99']:.0f} ms, "
              f"ITL p50 {row['itl_ms']['median']:.1f} ms, errors {row['requests_errored']}", flush=True)
    import torch

    meta = dict(tool=version, backend="openai_http, /v1/completions, streamed", profile="poisson",
                data=f"synthetic_text prompt_tokens={args.prompt_tokens} output_tokens={args.output_tokens}",
                tokenizer="byte-level (1 token per UTF-8 byte, 256 ids), built by bench/guidellm.py",
                requests_per_rate=args.requests, repeats=args.repeats, seed=args.seed,
                server=f"python -m serve.http on 127.0.0.1, fresh per rate, max-num-seqs {args.max_num_seqs}, "
                       "one warm-up request not counted",
                cpus=os.cpu_count(), omp_num_threads=1, python=platform.python_version(), torch=torch.__version__,
                measured=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make-tokenizer"]:
        make_byte_tokenizer(sys.argv[2])
    else:
        main()
