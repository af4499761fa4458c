"""Agreement of ours, transformers and llama.cpp on one Kimi-Linear folder: ``python -m bench.llama_cpp agree``.

Per held-out prompt (:func:`heldout_prompts`: prefixes of the corpus's held-out documents, byte ids) and engine:

- greedy agreement: the engine's greedy continuation of ``n`` tokens against transformers' own
  (``KimiLinearForCausalLM.generate``, no sampling); the first position where they differ (``None``: all ``n``
  agree);
- max |delta logprob| (nats): at each of the ``n`` positions of the engine's own continuation, for each of its
  top ``N_PROBS`` tokens, its log-prob against transformers' on the same prefix (one transformers forward over
  prompt + the engine's tokens), max over tokens and positions. Comparing on the engine's own path keeps the
  prefixes identical after a greedy divergence.

With each engine row goes transformers' routing margin (:meth:`Transformers.router_margins`) where the largest
delta and the first difference are: a margin near 0 is a near-tie of the MoE top-k, where a last-bit difference
picks another expert (a jump of nats at that position, then a decaying difference in the KDA states).

llama.cpp's KDA normalises q and k with eps = ``rms_norm_eps`` (1e-5 here; ``build_gdn_l2_norm`` in
``src/models/models.h``) where FLA, Moonshot's model and transformers use 1e-6. The llama.cpp rows are measured
against transformers as shipped and, to separate that one difference from everything else, against transformers
with its KDA L2 norm at llama.cpp's eps (:func:`kda_l2norm_eps`).

Engines: llama.cpp (:class:`bench.llama_cpp.LlamaServer` on the converted f32 GGUF, 1 thread) and ours through
the hook ``ours_fn(folder, prompt_ids, n) -> (logprobs, tokens)``: ``logprobs`` a float tensor of shape ``[n, V]``
(log-softmax at each generated position of its own greedy path), ``tokens`` its ``n`` greedy ids. Without a hook
the "ours" entries are ``None``. Also checked: llama.cpp's tokenisation of :data:`TOKENIZER_TEXTS` is their UTF-8
bytes and its detokenisation gives them back. Writes the results with the versions and the date.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from bench import llama_cpp
from bench.readme import REPO, write_section

AGREEMENT = REPO / "bench" / "results" / "llama_cpp_agreement.json"

N_PROBS = 5
# (name, corpus kind, bytes): prefixes of the first held-out documents of that kind with enough bytes, in the
# manifest's path order, one document each. 700 bytes > llama-server's 512-token micro-batch: two prefill steps.
PROMPT_SPECS = (("code-64", "code", 64), ("code-300", "code", 300), ("code-700", "code", 700),
                ("prose-200", "prose", 200), ("prose-600", "prose", 600))
UNICODE_PROMPT = "Grüße aus Zürich — naïve café, 東京の夜 🦙✅\nпривет, мир: "
TOKENIZER_TEXTS = ("Hello, world.  two  spaces\n\ttab\r\n", "héllo naïve façade", "🦙 😶\u200d🌫️ ✅ 👩🏽\u200d💻",
                   "我想在apple工作 нещо на Български", "\x00\x0b\x7f ' 's 're 333 3333", UNICODE_PROMPT)
OursFn = Callable[[Path, list[int], int], tuple[torch.Tensor, list[int]]]


def heldout_prompts() -> list[tuple[str, list[int]]]:
    """(name, byte ids) of :data:`PROMPT_SPECS` and the multilingual :data:`UNICODE_PROMPT` (not from the corpus:
    the held-out documents are ASCII)."""
    from train.corpus import documents

    docs = [d for d in documents() if d.split == "heldout"]
    used, out = set(), []
    for name, kind, size in PROMPT_SPECS:
        doc = next(d for d in docs if d.kind == kind and len(d.data) >= size and d.path not in used)
        used.add(doc.path)
        out.append((f"{name} ({doc.path})", list(doc.data[:size])))
    return out + [("unicode", list(UNICODE_PROMPT.encode()))]


@contextlib.contextmanager
def kda_l2norm_eps(eps: float):
    """For the duration, transformers' Kimi-Linear KDA normalises q and k with ``eps`` instead of 1e-6 (its
    ``l2norm``, looked up by ``torch_chunk_kda`` / ``torch_recurrent_kda`` at call time)."""
    import transformers.models.kimi_linear.modeling_kimi_linear as mk

    original = mk.l2norm

    def l2norm_at_eps(x: torch.Tensor, dim: int = -1, **_callers_eps) -> torch.Tensor:
        return original(x, dim=dim, eps=eps)

    mk.l2norm = l2norm_at_eps
    try:
        yield
    finally:
        mk.l2norm = original


def max_abs_delta(top: list[dict[int, float]], ref: torch.Tensor) -> float:
    """Max over positions i and tokens t of ``top[i]`` of |top[i][t] - ref[i, t]|; ``ref`` log-probs ``[n, V]``."""
    return max((abs(lp - ref[i, t].item()) for i, row in enumerate(top) for t, lp in row.items()), default=0.0)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """First index where ``a`` and ``b`` differ (over the shorter length), None if they agree."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


class Transformers:
    """transformers' ``KimiLinearForCausalLM`` of ``folder`` in fp32 (the reference)."""

    def __init__(self, folder: Path):
        from transformers import KimiLinearForCausalLM

        self.model = KimiLinearForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    @torch.no_grad()
    def logprobs(self, ids: list[int], n: int) -> torch.Tensor:
        """Log-softmax ``[n, V]`` predicting ``ids[-n:]`` (one forward over ``ids``)."""
        logits = self.model(torch.tensor([ids])).logits[0, -n - 1:-1]   # [n, V]
        return logits.float().log_softmax(-1)

    @torch.no_grad()
    def router_margins(self, ids: list[int], n: int) -> torch.Tensor:
        """Per position predicting ``ids[-n:]``: the smallest routing margin over the MoE layers, ``[n]``: the
        k-th best minus the (k+1)-th best expert score used for selection (sigmoid of the router logit plus
        ``e_score_correction_bias``). Near 0, a last-bit difference can pick another expert; inf without MoE."""
        margins = []

        def hook(router, args, _out):
            h = args[0].reshape(-1, router.hidden_dim).float()
            scores = torch.sigmoid(h @ router.weight.float().T) + router.e_score_correction_bias  # [T, E]
            best = scores.topk(router.top_k + 1, -1).values                                       # [T, k + 1]
            margins.append(best[:, -2] - best[:, -1])
        routers = [m for m in self.model.modules() if hasattr(m, "e_score_correction_bias")]
        handles = [r.register_forward_hook(hook) for r in routers]
        try:
            self.model(torch.tensor([ids]))
        finally:
            for h in handles:
                h.remove()
        if not margins:
            return torch.full((n,), float("inf"))
        return torch.stack(margins).min(0).values[-n - 1:-1]   # [n]

    @torch.no_grad()
    def greedy(self, ids: list[int], n: int) -> list[int]:
        """``n`` greedy tokens after ``ids`` (``generate`` with its cache: the decode path)."""
        out = self.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist()


def engine_row(ref: Transformers, ids: list[int], ref_tokens: list[int], tokens: list[int],
               top: list[dict[int, float]]) -> dict:
    """One engine's figures on one prompt against transformers (see the module docstring), with transformers'
    routing margin (:meth:`Transformers.router_margins`) where the largest delta and the first difference are."""
    n = len(tokens)
    ref_lp, margins = ref.logprobs(ids + tokens, n), ref.router_margins(ids + tokens, n)
    deltas = [max_abs_delta([row], ref_lp[i:i + 1]) for i, row in enumerate(top)]
    worst = max(range(n), key=deltas.__getitem__)
    diff = first_difference(tokens, ref_tokens)
    return {"max_abs_dlogprob": deltas[worst], "max_at": worst, "router_margin_at_max": margins[worst].item(),
            "greedy_first_difference": diff, "n": n,
            "router_margin_at_first_difference": None if diff is None else margins[diff].item()}


def tokenizer_check(server: llama_cpp.LlamaServer) -> dict:
    """llama.cpp's ids of :data:`TOKENIZER_TEXTS` == their UTF-8 bytes, and detokenising gives the text back."""
    bad = [t for t in TOKENIZER_TEXTS
           if server.tokenize(t) != list(t.encode()) or server.detokenize(list(t.encode())) != t]
    return {"texts": len(TOKENIZER_TEXTS), "ids_are_bytes_and_round_trip": not bad, "failing": bad}


def run(folder: Path, ours_fn: OursFn | None = None, n: int = 256) -> dict:
    """The agreement results for ``folder`` (a real-format Kimi-Linear folder with the byte tokenizer)."""
    import transformers

    config = json.loads((folder / "config.json").read_text())
    ref = Transformers(folder)
    gguf = llama_cpp.convert(folder)
    prompts = []
    with llama_cpp.LlamaServer(gguf) as server:
        tok = tokenizer_check(server)
        for name, ids in heldout_prompts():
            g = server.greedy(ids, n, N_PROBS)
            ref_tokens = ref.greedy(ids, n)
            with kda_l2norm_eps(config["rms_norm_eps"]):
                at_llama_eps = engine_row(ref, ids, ref.greedy(ids, n), g.tokens, g.top)
            row = {"prompt": name, "prompt_tokens": len(ids),
                   "llama_cpp": {**engine_row(ref, ids, ref_tokens, g.tokens, g.top),
                                 "eog_stops": g.eog_stops, "refetched_positions": g.refetched},
                   "llama_cpp_vs_transformers_at_llama_cpp_l2norm_eps": at_llama_eps,
                   "ours": None, "ours_vs_llama_cpp_greedy_first_difference": None}
            if ours_fn is not None:
                lp, tokens = ours_fn(folder, ids, n)
                top = [dict(zip(i.tolist(), v.tolist())) for v, i in zip(*lp.topk(N_PROBS, -1))]
                row["ours"] = engine_row(ref, ids, ref_tokens, list(tokens), top)
                row["ours_vs_llama_cpp_greedy_first_difference"] = first_difference(list(tokens), g.tokens)
            prompts.append(row)
            print(summary_line(row), flush=True)

    def summary(key):
        rows = [p[key] for p in prompts if p[key] is not None]
        return None if not rows else {"max_abs_dlogprob": max(r["max_abs_dlogprob"] for r in rows),
                                      "greedy_all_agree": all(r["greedy_first_difference"] is None for r in rows)}
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": {"llama_cpp": llama_cpp.version(), "transformers": transformers.__version__,
                     "torch": torch.__version__, "python": platform.python_version()},
        "machine": {"processor": platform.processor() or platform.machine(), "llama_cpp_threads": 1},
        "model": {"folder": folder.name, "gguf": gguf.name, "config": config},
        "settings": {"greedy_tokens": n, "top_logprobs": N_PROBS,
                     "llama_cpp": "llama-server /completion, f32 GGUF, f32 KV cache, flash attention off, top_k 1, "
                                  "temperature 0, 1 thread",
                     "transformers": "fp32; generate (greedy, its cache) and one forward (log-probs)"},
        "tokenizer": tok,
        "prompts": prompts,
        "summary": {"llama_cpp": summary("llama_cpp"),
                    "llama_cpp_at_llama_cpp_l2norm_eps": summary("llama_cpp_vs_transformers_at_llama_cpp_l2norm_eps"),
                    "ours": summary("ours")},
    }


def summary_line(row: dict) -> str:
    """One printed line per prompt."""
    def fmt(e):
        if e is None:
            return "-"
        diff = e["greedy_first_difference"]
        return f"max|dlp| {e['max_abs_dlogprob']:.2e}, greedy {'all ' + str(e['n']) if diff is None else 'differs at ' + str(diff)}"
    eps = row["llama_cpp_vs_transformers_at_llama_cpp_l2norm_eps"]
    return (f"{row['prompt']:<50} {row['prompt_tokens']:>4} tok | llama.cpp: {fmt(row['llama_cpp'])} "
            f"(at its L2 eps: {fmt(eps)}) | ours: {fmt(row['ours'])}")


def run_cli(folder: str | None, n: int, out: Path, ours_fn: OursFn | None = None) -> dict:
    """``agree``: on ``folder`` (default: the tiny random model, written to the cache), print and write ``out``."""
    if folder is None:
        from bench.tiny_kimi import write_tiny_kimi
        path = write_tiny_kimi(llama_cpp.CACHE / "tiny-kimi-linear")
    else:
        path = Path(folder).resolve()
    res = run(path, ours_fn, n)
    res["model"]["kind"] = "tiny random (bench.tiny_kimi, seed 0)" if folder is None else "given folder"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res["summary"]), "->", out)
    if out.resolve() == AGREEMENT and path.name == "kda-demo":
        write_section("## Checked against transformers and llama.cpp", readme_section(res), "## Performance",
                      REPO / "README.md")
    return res


def readme_section(res: dict) -> str:
    """The body of README.md's ``Checked against transformers and llama.cpp`` section for an ``agree`` result on
    the shipped weights: one row per held-out prompt, ours and llama.cpp each against transformers."""
    v = res["versions"]
    n = res["settings"]["greedy_tokens"]

    def greedy(r: dict) -> str:
        first = r["greedy_first_difference"]
        return "all agree" if first is None else f"first differs at {first}"

    rows = [f"| {p['prompt']} | {p['prompt_tokens']} | {p['ours']['max_abs_dlogprob']:.1e} | {greedy(p['ours'])} "
            f"| {p['llama_cpp']['max_abs_dlogprob']:.1e} | {greedy(p['llama_cpp'])} |" for p in res["prompts"]]
    return "\n".join([
        "The shipped weights (`weights/kda-demo`) in three implementations, each against transformers'",
        f"`KimiLinearForCausalLM` on held-out prompts: the largest |Δ logprob| (nats) of each engine's top "
        f"{res['settings']['top_logprobs']} tokens over {n}",
        f"greedy positions, and whether its {n} greedy tokens equal transformers'. Run {res['date'][:10]} with llama.cpp",
        f"{v['llama_cpp']['server_version']} ({v['llama_cpp']['sdist']} sdist, converted by llama.cpp's own",
        f"`convert_hf_to_gguf.py`, f32, {res['machine']['llama_cpp_threads']} thread), transformers {v['transformers']}, "
        f"torch {v['torch']}; regenerated by",
        "`python -m bench.llama_cpp agree weights/kda-demo --ours bench.kimi_agreement:ours_engine` (`bench/README.md`),",
        "shown on page 18.", "",
        f"| prompt | tokens | ours: max \\|Δ logprob\\| | ours: greedy {n} | llama.cpp: max \\|Δ logprob\\| "
        f"| llama.cpp: greedy {n} |",
        "|---|---:|---:|---|---:|---|", *rows])


def ours_engine(folder: Path, prompt_ids: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """The ``ours_fn`` hook on our serving engine: the folder served as ``python -m serve.http --model-path``
    builds it (:func:`serve.http.model.build_engine`, prefix cache on, one request), greedy ``n`` tokens with each
    emitted token's logits recorded; returns (log-softmax ``[n, V]`` fp32, the ``n`` token ids)."""
    from serve.http.model import EngineSpec, build_engine

    spec = EngineSpec(max_model_len=len(prompt_ids) + n + 1, max_num_seqs=1, model_path=str(folder))
    res = build_engine(spec).generate(prompt_ids, n, record_logits=True)
    if res.logits is None or len(res.output_tokens) != n:
        raise RuntimeError(f"our engine did not finish the request: {res.status} {res.reason}")
    return torch.log_softmax(res.logits.float(), dim=-1), list(res.output_tokens)
