"""The three engines ``python -m bench.peers`` times on one checkpoint, each behind the same two calls:
``prefill(tokens, threads)`` and ``decode(batch, threads)``, both returning tokens/s of one measurement.

=================  ==========================================================================================
engine             what one measurement is
=================  ==========================================================================================
:class:`Ours`      ``ServeEngine`` (no prefix cache, 16-token blocks). Prefill: one request's whole prompt in one
                   chunk, prompt tokens / its time to first token (``generate(prompt, 1)``). Decode: B requests
                   of :data:`lab.batching.DECODE_PROMPT_TOKENS`-token prompts all decoding
                   (:func:`lab.batching.decoding_engine`), B x steps / the wall time of ``steps`` engine steps
                   (:func:`lab.batching.time_steps`).
:class:`HF`        transformers' ``KimiLinearForCausalLM`` in fp32 (its pure-torch fallbacks). Prefill: one forward
                   of the prompt with the cache on. Decode: ``generate`` (greedy) on B left-padded prompts of the
                   same length (:data:`HF_DECODE_PROMPT_TOKENS`); a ``StoppingCriteria`` stamps every step, and the decode time is from the stamp after
                   the first token (prefill + first token) to the last: B x steps / that time.
:class:`LlamaCpp`  llama.cpp's own benchmarks on the f32 GGUF its converter wrote. Prefill: ``llama-bench -p
                   ... -n 0 -r 1`` (its warm-up run first), one process for every size and thread count of a
                   repeat. Decode: ``llama-batched-bench -npl ...`` (one process per thread count and repeat),
                   ``speed_tg`` = B x ntg / the time of its ntg generation steps after a B x npp prefill.
=================  ==========================================================================================

:func:`parse_llama_bench` and :func:`parse_batched_bench` read the two programs' machine-readable output
(``-o json``; ``--output-format jsonl``). :func:`llama_cpp_missing` says how to build llama.cpp when it is not.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import torch

from bench import llama_cpp
from lab.batching import DECODE_PROMPT_TOKENS, decoding_engine, time_steps
from lab.models import demo_model
from serve.config import ServeConfig
from serve.engine import ServeEngine
from serve.memory.pool import PagePool

BLOCK = 16
# transformers' decode prompts: 1 token. Its pure-torch chunk fallback pads any longer prompt to a 64-token chunk
# and a batched prefill of 32-token prompts took 11 s at batch 64 here (5.5 s at 32), every measurement; a 1-token
# prompt takes its recurrent path. The decode context is then 31 tokens shorter than ours and llama.cpp's, which
# changes only the MLA layers' attention: 31 x 1,280 FLOPs per token, 1 % of the token's ~4 MFLOP.
HF_DECODE_PROMPT_TOKENS = 1


def prompt(tokens: int, row: int = 0) -> list[int]:
    """A deterministic prompt of ``tokens`` byte ids (the pattern :func:`lab.batching.decoding_engine` uses)."""
    return [(row * 7 + j) % 256 for j in range(tokens)]


class Ours:
    """Our engine on the shipped ``demo`` model (``weights/kda-demo``): one engine per prefill size, one per
    decode batch with its B requests already decoding and ``decode_tokens`` tokens left to each (enough for every
    step the run will take: a request that finished would shrink the batch, and :meth:`decode` raises
    RuntimeError then)."""

    name = "ours"

    def __init__(self, prefill_tokens: tuple[int, ...], batches: tuple[int, ...], decode_tokens: int):
        model = demo_model("demo")
        config = ServeConfig(BLOCK, BLOCK, page_policy="unified")
        self.prefill_engines = {}
        for t in prefill_tokens:
            pages = 1 + -(-(t + 1) // BLOCK) + 8                 # state + KV blocks of prompt and one token + spare
            self.prefill_engines[t] = ServeEngine(model, PagePool(pages, config.page_bytes(model.cfg)), None,
                                                  config=config)
        self.decode_engines = {b: decoding_engine(model, b, decode_tokens) for b in batches}

    def prefill(self, tokens: int, threads: int) -> float:
        torch.set_num_threads(threads)
        eng = self.prefill_engines[tokens]
        t0 = time.perf_counter()
        res = eng.generate(prompt(tokens), 1)
        dt = time.perf_counter() - t0
        if len(res.output_tokens) != 1:
            raise RuntimeError(f"our engine did not finish a {tokens}-token prefill: {res.status} {res.reason}")
        return tokens / dt

    def decode(self, batch: int, threads: int, steps: int) -> float:
        torch.set_num_threads(threads)
        eng = self.decode_engines[batch]
        if len(eng.running) != batch:
            raise RuntimeError(f"decode batch {batch}: {len(eng.running)} requests left (decode_tokens too small)")
        return batch * steps / time_steps(eng, steps)


class HF:
    """transformers' ``KimiLinearForCausalLM`` of ``folder`` (fp32, eval). Raises ImportError when transformers
    lacks the class."""

    name = "transformers"

    def __init__(self, folder: Path):
        import transformers
        from transformers import KimiLinearForCausalLM

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        self.version = transformers.__version__
        self.model = KimiLinearForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    @torch.no_grad()
    def prefill(self, tokens: int, threads: int) -> float:
        torch.set_num_threads(threads)
        ids = torch.tensor([prompt(tokens)])                       # [1, T]
        t0 = time.perf_counter()
        self.model(ids, use_cache=True)
        return tokens / (time.perf_counter() - t0)

    @torch.no_grad()
    def decode(self, batch: int, threads: int, steps: int) -> float:
        from transformers import StoppingCriteria, StoppingCriteriaList

        stamps: list[float] = []

        class Stamp(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        torch.set_num_threads(threads)
        ids = torch.tensor([prompt(HF_DECODE_PROMPT_TOKENS, r) for r in range(batch)])   # [B, 1], equal lengths
        self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps + 1,
                            min_new_tokens=steps + 1, do_sample=False, eos_token_id=None, pad_token_id=0,
                            stopping_criteria=StoppingCriteriaList([Stamp()]))
        if len(stamps) != steps + 1:
            raise RuntimeError(f"generate stamped {len(stamps)} steps, expected {steps + 1}")
        return batch * steps / (stamps[-1] - stamps[0])


def llama_cpp_missing(cache: Path = llama_cpp.CACHE) -> str | None:
    """None when llama-bench and llama-batched-bench are built in ``cache``; otherwise what to do, in a sentence."""
    for name in ("llama-bench", "llama-batched-bench"):
        try:
            llama_cpp.binary(name, cache)
        except FileNotFoundError:
            return (f"llama.cpp is not built ({llama_cpp.tree(cache) / 'build' / 'bin' / name} is missing): build it "
                    "with `python -m bench.llama_cpp build` (cmake and a C++ compiler; a few minutes), then rerun")
    return None


def parse_llama_bench(text: str) -> dict[tuple[int, int], float]:
    """``llama-bench -o json`` output -> {(prompt tokens, threads): tokens/s} of its prompt-processing tests
    (``n_gen`` 0), the mean over its repetitions (``avg_ts``). Raises ValueError if ``text`` is not that JSON."""
    try:
        tests = json.loads(text)
        return {(int(t["n_prompt"]), int(t["n_threads"])): float(t["avg_ts"]) for t in tests if t["n_gen"] == 0}
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"not llama-bench JSON output ({type(err).__name__}: {err}): {text[:200]!r}") from None


def parse_batched_bench(text: str) -> dict[tuple[int, int], float]:
    """``llama-batched-bench --output-format jsonl`` output (one JSON object per line; other lines ignored) ->
    {(parallel sequences ``pl``, threads): generation tokens/s ``speed_tg``}. Raises ValueError if no line is
    such an object."""
    out = {}
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                d = json.loads(line)
                out[(int(d["pl"]), int(d["n_threads"]))] = float(d["speed_tg"])
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"not llama-batched-bench jsonl ({type(err).__name__}: {err}): {line[:200]!r}") \
                    from None
    if not out:
        raise ValueError(f"no llama-batched-bench result line in: {text[:200]!r}")
    return out


def cached_gguf(folder: Path, cache: Path = llama_cpp.CACHE) -> Path:
    """The f32 GGUF of ``folder`` in ``cache``: reused when newer than every file of the folder, else converted
    again (:func:`bench.llama_cpp.convert`, llama.cpp's own converter)."""
    out = cache / "gguf" / f"{Path(folder).resolve().name}-f32.gguf"
    newest = max(p.stat().st_mtime for p in Path(folder).iterdir() if p.is_file())
    if out.is_file() and out.stat().st_mtime >= newest:
        return out
    return llama_cpp.convert(folder, cache)


class LlamaCpp:
    """llama.cpp's ``llama-bench`` and ``llama-batched-bench`` on ``gguf``; f32 weights, flash attention off.
    Raises FileNotFoundError (saying how to build) when a program is missing."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, cache: Path = llama_cpp.CACHE):
        self.gguf, self.bench, self.batched = gguf, llama_cpp.binary("llama-bench", cache), \
            llama_cpp.binary("llama-batched-bench", cache)

    @staticmethod
    def _run(cmd: list[str]) -> str:
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            tail = "\n".join(run.stderr.splitlines()[-10:])
            raise RuntimeError(f"{Path(cmd[0]).name} failed (exit {run.returncode}):\n{tail}")
        return run.stdout

    def prefill_cmd(self, tokens: tuple[int, ...], threads: tuple[int, ...]) -> list[str]:
        """One llama-bench process: every prompt size at every thread count, one repetition each."""
        return [str(self.bench), "-m", str(self.gguf), "-p", ",".join(map(str, tokens)), "-n", "0",
                "-t", ",".join(map(str, threads)), "-r", "1", "-fa", "off", "-o", "json"]

    def decode_cmd(self, batches: tuple[int, ...], threads: int, ntg: int) -> list[str]:
        """One llama-batched-bench process: every batch at ``threads``, B prompts of the decode prompt length
        (f32 K / V cache; context for the largest batch)."""
        ctx = max(batches) * (DECODE_PROMPT_TOKENS + ntg)
        return [str(self.batched), "-m", str(self.gguf), "-c", str(ctx), "-npp", str(DECODE_PROMPT_TOKENS),
                "-ntg", str(ntg), "-npl", ",".join(map(str, batches)), "-t", str(threads), "-tb", str(threads),
                "-ctk", "f32", "-ctv", "f32", "-fa", "off", "--output-format", "jsonl"]

    def prefill(self, tokens: tuple[int, ...], threads: tuple[int, ...]) -> dict[tuple[int, int], float]:
        return parse_llama_bench(self._run(self.prefill_cmd(tokens, threads)))

    def decode(self, batches: tuple[int, ...], threads: int, ntg: int, tries: int = 3) -> dict[tuple[int, int], float]:
        """{(batch, threads): generation tokens/s} of one llama-batched-bench run. That tool (this build, on a
        hybrid Kimi-Linear GGUF) now and then exits 0 without the result line of a batch (seen in about 1 run of
        10 with ``-npl 1,2``): a run missing a requested batch is run again, up to ``tries`` runs in all.
        Raises RuntimeError if every run missed one."""
        for _ in range(tries):
            got = parse_batched_bench(self._run(self.decode_cmd(batches, threads, ntg)))
            if {b for b, t in got if t == threads} >= set(batches):
                return got
        missing = sorted(set(batches) - {b for b, t in got if t == threads})
        raise RuntimeError(f"llama-batched-bench gave no result for batches {missing} in {tries} runs")
