"""Minimal reproductions of what llama.cpp does differently with Kimi-Linear and a byte vocabulary:
``python -m bench.llama_cpp_findings`` (after ``python -m bench.llama_cpp build``).

Each check runs on the tiny random model of :mod:`bench.tiny_kimi` (or a one-layer variant) and returns plain data;
``main`` prints them and writes ``bench/results/llama_cpp_findings.json``. ``bench/README.md`` explains each.

- :func:`l2norm_eps`: llama.cpp's KDA normalises q and k with eps = ``rms_norm_eps`` (``build_gdn_l2_norm(...,
  hparams.f_norm_rms_eps)`` in ``src/models/kimi-linear.cpp``); FLA's ``l2norm`` (Moonshot's model, transformers)
  uses 1e-6. One-token prompt: log-prob difference to transformers as shipped and at llama.cpp's eps.
- :func:`dropped_probabilities`: ``/completion`` with ``n_probs`` returns fewer ``completion_probabilities`` than
  generated tokens: ``process_token`` adds a token's entry only when the text so far does not end inside a UTF-8
  sequence, and never adds it later.
- :func:`default_eog`: a GPT-2-type vocabulary whose GGUF names no EOS gets id 11 as BOS / EOS
  (``llama-vocab.cpp``), so greedy generation stops at the byte 0x0B.
- :func:`single_kind_crash`: a Kimi-Linear with only KDA layers (or only MLA layers) aborts on its first decode
  (``GGML_ASSERT(buffer)`` from ``llm_graph_input_mem_hybrid_k::set_input``).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from bench import llama_cpp
from bench.kimi_agreement import Transformers, kda_l2norm_eps
from bench.tiny_kimi import TINY, to_real_format, write_tiny_kimi
from kda_core.tokenizer import write_tokenizer

OUT = Path(__file__).parent / "results" / "llama_cpp_findings.json"
PROMPT = list(b"def f(x):\n    return")


def l2norm_eps(folder: Path, server: llama_cpp.LlamaServer) -> dict:
    """Max |delta logprob| of llama.cpp's top 5 after the one-token prompt "d", against transformers as shipped
    (KDA L2 eps 1e-6) and at llama.cpp's eps (``rms_norm_eps``)."""
    ref, eps = Transformers(folder), json.loads((folder / "config.json").read_text())["rms_norm_eps"]
    top = server.next_logprobs(PROMPT[:1], 5)

    def delta() -> float:
        lp = ref.logprobs(PROMPT[:1] + [0], 1)[0]
        return max(abs(v - lp[t].item()) for t, v in top.items())
    shipped = delta()
    with kda_l2norm_eps(eps):
        aligned = delta()
    return {"transformers_l2norm_eps": 1e-6, "llama_cpp_l2norm_eps": eps,
            "max_abs_dlogprob_as_shipped": shipped, "max_abs_dlogprob_at_llama_cpp_eps": aligned}


def dropped_probabilities(server: llama_cpp.LlamaServer, n: int = 40) -> dict:
    """Generated tokens vs ``completion_probabilities`` entries for ``n`` greedy tokens after :data:`PROMPT`."""
    res = server.post("/completion", {"prompt": PROMPT, "n_predict": n, "n_probs": 1, "temperature": 0.0,
                                      "top_k": 1, "return_tokens": True, "cache_prompt": False})
    tokens = res["tokens"]
    return {"tokens": len(tokens), "probability_entries": len(res["completion_probabilities"]),
            "tokens_at_or_above_0x80": sum(t >= 0x80 for t in tokens),
            "entries_match_prediction_of_listed_positions":
                [e["id"] for e in res["completion_probabilities"]]
                == [tokens[i] for i in llama_cpp.listed_positions(tokens)]}


def default_eog(server: llama_cpp.LlamaServer, prompt: list[int], n: int = 256) -> dict:
    """Where greedy generation after ``prompt`` stops, and the last token (11 when it is the default EOS)."""
    res = server.post("/completion", {"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1,
                                      "return_tokens": True, "cache_prompt": False})
    return {"asked": n, "generated": len(res["tokens"]), "stop_type": res["stop_type"],
            "last_token": res["tokens"][-1] if res["tokens"] else None}


def single_kind_crash(kind: str, root: Path) -> dict:
    """Convert and start a one-layer Kimi-Linear whose layer is ``kind`` (``linear_attention`` or
    ``full_attention``); the server's error line if it does not start."""
    torch.manual_seed(0)
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = {**TINY, "num_hidden_layers": 1, "layer_types": [kind], "mlp_layer_types": ["dense"]}
    folder = root / f"one-{kind}"
    with tempfile.TemporaryDirectory() as tmp:
        KimiLinearForCausalLM(KimiLinearConfig(**cfg)).save_pretrained(tmp)
        to_real_format(tmp, folder)
    write_tokenizer(folder)
    server = llama_cpp.LlamaServer(llama_cpp.convert(folder))
    try:
        with server:
            server.next_logprobs(PROMPT, 1)
        return {"layer": kind, "runs": True, "error": None}
    except RuntimeError:
        log = server.log.read_text(errors="replace").splitlines()
        asserts = [ln.rsplit("/", 1)[-1] for ln in log if "GGML_ASSERT" in ln]     # "file.cpp:N: GGML_ASSERT(...)"
        frames = [ln.split(" in ", 1)[1].split(" (")[0] for ln in log if ln.startswith("#") and " in " in ln]
        frames = [f for f in frames if f not in ("__GI___wait4", "ggml_print_backtrace", "ggml_abort")]
        return {"layer": kind, "runs": False, "error": asserts[:1], "frames": frames[:5]}


def main() -> None:
    from bench.kimi_agreement import heldout_prompts

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = write_tiny_kimi(root / "tiny")
        with llama_cpp.LlamaServer(llama_cpp.convert(folder)) as server:
            found = {"version": llama_cpp.version(), "l2norm_eps": l2norm_eps(folder, server),
                     "dropped_probabilities": dropped_probabilities(server),
                     "default_eog": default_eog(server, heldout_prompts()[0][1])}
        found["single_kind_crash"] = [single_kind_crash(k, root) for k in ("linear_attention", "full_attention")]
    OUT.write_text(json.dumps(found, indent=1) + "\n")
    print(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
