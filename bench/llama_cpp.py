"""llama.cpp beside our engine: build it, convert a Kimi-Linear folder with its own converter, run it.

    python -m bench.llama_cpp build              # llama-cpp-python 0.3.36's vendored llama.cpp, cmake (reused)
    python -m bench.llama_cpp tiny [FOLDER]      # the tiny random Kimi-Linear (bench.tiny_kimi), real format
    python -m bench.llama_cpp convert FOLDER     # -> f32 GGUF in the cache, with llama.cpp's convert_hf_to_gguf.py
    python -m bench.llama_cpp agree [FOLDER] [--ours MODULE:FUNCTION]   # ours vs transformers vs llama.cpp

The cache (``$KDA_LAB_CACHE``, default ``~/.cache/kda-lab``) holds the sdist's tree, its ``build/`` and the GGUFs;
nothing of llama.cpp enters the repo. :func:`build` fetches the sdist with ``pip download --no-binary`` and
builds :data:`TARGETS` with cmake (Release, native CPU); an existing ``build/`` is reused (``cmake --build`` only
recompiles what changed).

Conversion (:func:`convert`): llama.cpp's converter, unmodified, with one addition registered in the child
process that runs it: it recognises a tokenizer by the sha256 of the ids it gives a fixed text
(``get_vocab_base_pre``, table made by ``convert_hf_to_gguf_update.py``), and no model's tokenizer there is our
byte vocabulary. :class:`ByteVocabKimiLinear` answers ``"kimi-k2"`` (Kimi's own pre-tokenizer, the one
Kimi-Linear's real tokenizer uses) when the folder's tokenizer has 256 tokens and encodes the probe text to its
UTF-8 bytes, and defers to the converter otherwise. ``kimi-k2`` is also the one BPE pre-tokenizer for which
llama.cpp loads a vocabulary without merges (``llama-vocab.cpp``: "Kimi-K2 doesn't need merges"); for any other
it stops with "cannot find tokenizer merges", and the converter's GGUF writer cannot write an empty merges list.
With no merges the split does not change the ids: llama.cpp tokenises text to its bytes (checked by
:meth:`LlamaServer.tokenize` in ``agree``).

Running (:class:`LlamaServer`): ``llama-server`` on 127.0.0.1, 1 thread, one slot, no prompt cache; greedy
(``top_k`` 1, temperature 0) via ``/completion`` on token-id prompts, with ``n_probs`` top log-probs computed by
llama.cpp from the raw logits. Two llama.cpp behaviours that a byte vocabulary meets (``bench/README.md``):
a GPT-2 type vocabulary with no ``eos_token_id`` gets id 11 as BOS / EOS (for us the byte ``\\v``), so generation
stops there and :meth:`LlamaServer.greedy` resumes; and ``completion_probabilities`` leaves out a token whose
text ends inside a UTF-8 sequence, so :meth:`LlamaServer.greedy` aligns the entries it gets by id and asks for
the missing positions one by one (:meth:`LlamaServer.next_logprobs`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("KDA_LAB_CACHE", Path.home() / ".cache" / "kda-lab"))
SDIST = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-bench", "llama-batched-bench", "llama-cli")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF")
BYTE_PROBE = "\n \t\t 🚀 😶\u200d🌫️ ✅ 3.33 កាន់តែ 我想在apple工作 нещо I've 'RE ……"
EOG_DEFAULT_ID = 11    # llama-vocab.cpp: a gpt2-type vocabulary's BOS / EOS when the GGUF names none


def tree(cache: Path = CACHE) -> Path:
    """The vendored llama.cpp source tree of the sdist in ``cache`` (fetched by :func:`fetch` if absent)."""
    return cache / f"{SDIST.replace('-', '_')}-{SDIST_VERSION}" / "vendor" / "llama.cpp"


def fetch(cache: Path = CACHE) -> Path:
    """Download and unpack the sdist into ``cache`` unless its tree is there. Returns the tree.
    Raises ``RuntimeError`` with pip's output if the download fails."""
    src = tree(cache)
    if (src / "CMakeLists.txt").is_file():
        return src
    dl = cache / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
           "-d", str(dl), f"{SDIST}=={SDIST_VERSION}"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    archives = sorted(dl.glob(f"{SDIST.replace('-', '_')}-{SDIST_VERSION}.tar.gz"))
    if not archives:
        raise RuntimeError(f"pip download of {SDIST}=={SDIST_VERSION} gave no sdist:\n{run.stdout}\n{run.stderr}")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(cache, filter="data")
    return src


def binary(name: str, cache: Path = CACHE) -> Path:
    """Path of a built llama.cpp program. Raises ``FileNotFoundError`` saying to run ``build`` if absent."""
    path = tree(cache) / "build" / "bin" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `python -m bench.llama_cpp build` first")
    return path


def build(cache: Path = CACHE, jobs: int = os.cpu_count() or 1) -> Path:
    """Build :data:`TARGETS` in ``tree/build`` (configured once; later calls only recompile what changed).
    Returns the ``bin`` folder. Raises ``subprocess.CalledProcessError`` if cmake fails."""
    src = fetch(cache)
    out = src / "build"
    if not (out / "CMakeCache.txt").is_file():
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), *CMAKE_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(out), "--target", *TARGETS, "-j", str(jobs)], check=True)
    return out / "bin"


def version(cache: Path = CACHE) -> dict:
    """The llama.cpp that runs: the sdist, the tree's git commit and date (the sdist ships its ``.git``), and
    ``llama-server --version``'s build line."""
    src = tree(cache)
    git = subprocess.run(["git", "-C", str(src), "log", "-1", "--format=%H %cI"], capture_output=True, text=True)
    commit, _, date = git.stdout.strip().partition(" ")
    ver = subprocess.run([str(binary("llama-server", cache)), "--version"], capture_output=True, text=True)
    line = next((ln for ln in (ver.stdout + ver.stderr).splitlines() if ln.startswith("version:")), "")
    return {"sdist": f"{SDIST}=={SDIST_VERSION}", "commit": commit, "commit_date": date,
            "server_version": line.removeprefix("version:").strip()}


def convert_in_process(src: str, folder: str, out: str) -> None:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` from tree ``src`` on ``folder`` -> f32 ``out``, in this process,
    with :class:`ByteVocabKimiLinear` registered (see the module docstring). Called by :func:`convert` in a
    child process, as the converter configures logging and imports its own ``gguf``."""
    import importlib.util

    sys.path[:0] = [src, str(Path(src) / "gguf-py")]
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", Path(src) / "convert_hf_to_gguf.py")
    converter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(converter)
    from conversion.base import ModelBase
    from conversion.kimi_linear import KimiLinearModel

    class ByteVocabKimiLinear(KimiLinearModel):
        """KimiLinearModel whose pre-tokenizer check also knows the byte vocabulary (ids 0..255 = the bytes)."""

        model_arch = KimiLinearModel.model_arch

        def get_vocab_base_pre(self, tokenizer) -> str:
            if len(tokenizer.get_vocab()) == 256 and tokenizer.encode(BYTE_PROBE) == list(BYTE_PROBE.encode()):
                return "kimi-k2"
            return super().get_vocab_base_pre(tokenizer)

    ModelBase.register("KimiLinearForCausalLM")(ByteVocabKimiLinear)
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outtype", "f32", "--outfile", out]
    converter.main()


def convert(folder: str | Path, cache: Path = CACHE) -> Path:
    """Convert the real-format Kimi-Linear ``folder`` to an f32 GGUF in ``cache/gguf`` (rewritten each call).
    Returns its path. Raises ``RuntimeError`` with the converter's last output lines if it fails."""
    folder = Path(folder).resolve()
    out = cache / "gguf" / f"{folder.name}-f32.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    code = "import sys; from bench.llama_cpp import convert_in_process; convert_in_process(*sys.argv[1:])"
    run = subprocess.run([sys.executable, "-c", code, str(tree(cache)), str(folder), str(out)], cwd=REPO,
                         capture_output=True, text=True)
    if run.returncode != 0 or not out.is_file():
        tail = "\n".join((run.stdout + run.stderr).splitlines()[-15:])
        raise RuntimeError(f"llama.cpp's converter failed on {folder}:\n{tail}")
    return out


class Greedy(NamedTuple):
    """A greedy continuation: ``tokens`` (ids, length n) and ``top`` (per position, {id: logprob} of the top
    ``n_probs`` tokens, nats); ``eog_stops`` how many times generation stopped at the end-of-generation id and
    was resumed; ``refetched`` how many positions' log-probs came from a one-token request."""

    tokens: list[int]
    top: list[dict[int, float]]
    eog_stops: int
    refetched: int


def listed_positions(tokens: list[int]) -> list[int]:
    """The positions (in a ``/completion``'s generated ``tokens``, byte ids) that ``completion_probabilities``
    lists: llama-server (``process_token``) adds a token's entry only if the generated text after it does not
    end inside a UTF-8 sequence (``validate_utf8``: a lead byte among the last 1-3 bytes announcing more bytes
    than follow it)."""
    listed, text = [], b""
    for i, tok in enumerate(tokens):
        text += bytes([tok])
        tail = text[-4:]
        cut = any(need > back for back, c in enumerate(reversed(tail), start=1)
                  for need in [2 if c & 0xE0 == 0xC0 else 3 if c & 0xF0 == 0xE0 else 4 if c & 0xF8 == 0xF0 else 0])
        if not cut:
            listed.append(i)
    return listed


class LlamaServer:
    """``llama-server`` on ``gguf`` at 127.0.0.1 (a free port), 1 thread, one slot, ``ctx`` tokens of context.
    A context manager: starts on enter (waits for ``/health``), stops on exit. Raises ``RuntimeError`` with the
    server's last log lines if it does not come up in ``timeout_s``."""

    def __init__(self, gguf: Path, ctx: int = 4096, cache: Path = CACHE, timeout_s: float = 120.0):
        self.gguf, self.ctx, self.cache, self.timeout_s = Path(gguf), ctx, cache, timeout_s

    def __enter__(self) -> LlamaServer:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url, self.log = f"http://127.0.0.1:{port}", self.cache / "logs" / f"llama-server-{port}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [str(binary("llama-server", self.cache)), "-m", str(self.gguf), "--host", "127.0.0.1",
               "--port", str(port), "-t", "1", "-tb", "1", "-np", "1", "-c", str(self.ctx), "--no-webui",
               # f32 attention: the MLA cache in f32 (default f16) and no flash attention (llama-graph.cpp casts
               # K and V to f16 for ggml_flash_attn_ext even when the cache is f32: logprobs off by ~2e-4)
               "-ctk", "f32", "-ctv", "f32", "-fa", "off"]
        self._logf = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._logf, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.__exit__(None, None, None)
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"llama-server did not start on {self.gguf}:\n{tail}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._logf.close()

    def post(self, path: str, body: dict) -> dict:
        """POST ``body`` as JSON to ``path``; the decoded JSON reply. Raises ``RuntimeError`` on an HTTP error."""
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"llama-server {path}: HTTP {e.code}: {e.read()[:500]!r}") from e

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's token ids of ``text`` (no BOS added, special tokens not parsed)."""
        return self.post("/tokenize", {"content": text, "add_special": False, "parse_special": False})["tokens"]

    def detokenize(self, ids: list[int]) -> str:
        """llama.cpp's text of ``ids``."""
        return self.post("/detokenize", {"tokens": ids})["content"]

    def _complete(self, ids: list[int], n: int, n_probs: int, **extra) -> dict:
        body = {"prompt": ids, "n_predict": n, "n_probs": n_probs, "temperature": 0.0, "top_k": 1,
                "samplers": ["top_k", "temperature"], "cache_prompt": False, "return_tokens": True, **extra}
        return self.post("/completion", body)

    def next_logprobs(self, ids: list[int], n_probs: int) -> dict[int, float]:
        """Top ``n_probs`` {id: logprob} of the next token after ``ids`` (prefill of all of ``ids``). The one
        generated token is biased to ``A`` so that llama-server lists its entry; the log-probs are the raw
        logits' (the bias acts in the sampler only)."""
        res = self._complete(ids, 1, n_probs, logit_bias=[[ord("A"), 1e9]])
        (entry,) = res["completion_probabilities"]
        return {t["id"]: t["logprob"] for t in entry["top_logprobs"]}

    def greedy(self, ids: list[int], n: int, n_probs: int) -> Greedy:
        """Greedy continuation of ``ids`` for ``n`` tokens with the top ``n_probs`` log-probs at each position
        (see the module docstring for the resumes and refetches). Raises ``RuntimeError`` if the listed entries
        do not line up with the generated tokens."""
        tokens, top, stops, refetched = [], [], 0, 0
        while len(tokens) < n:
            res = self._complete(ids + tokens, n - len(tokens), n_probs)
            got, entries = res["tokens"], res.get("completion_probabilities", [])
            listed = listed_positions(got)
            if [got[i] for i in listed] != [e["id"] for e in entries]:
                raise RuntimeError("llama-server's completion_probabilities do not line up with its tokens")
            by_pos = {i: {t["id"]: t["logprob"] for t in e["top_logprobs"]} for i, e in zip(listed, entries)}
            for i in range(len(got)):
                if i not in by_pos:
                    by_pos[i] = self.next_logprobs(ids + tokens + got[:i], n_probs)
                    refetched += 1
            top += [by_pos[i] for i in range(len(got))]
            tokens += got
            if len(tokens) < n and res.get("stop_type") == "eos":
                stops += 1
            elif len(tokens) < n:
                raise RuntimeError(f"llama-server stopped after {len(tokens)} of {n} tokens: {res.get('stop_type')}")
        return Greedy(tokens, top, stops, refetched)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.llama_cpp", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="fetch the sdist and build llama.cpp (reused when built)")
    tiny = sub.add_parser("tiny", help="write the tiny random Kimi-Linear (real format)")
    tiny.add_argument("folder", nargs="?", default=str(CACHE / "tiny-kimi-linear"))
    conv = sub.add_parser("convert", help="convert a model folder to an f32 GGUF in the cache")
    conv.add_argument("folder")
    agree = sub.add_parser("agree", help="ours vs transformers vs llama.cpp on held-out prompts")
    agree.add_argument("folder", nargs="?", default=None, help="model folder (default: the tiny random model)")
    agree.add_argument("--n", type=int, default=256, help="greedy tokens per prompt")
    agree.add_argument("--ours", default=None, metavar="MODULE:FUNCTION",
                       help="our engine: ours_fn(folder, prompt_ids, n) -> (logprobs [n, V], tokens)")
    agree.add_argument("--out", default=str(REPO / "bench" / "results" / "llama_cpp_agreement.json"))
    args = p.parse_args(argv)
    if args.cmd == "build":
        print(build())
    elif args.cmd == "tiny":
        from bench.tiny_kimi import write_tiny_kimi
        print(write_tiny_kimi(args.folder))
    elif args.cmd == "convert":
        print(convert(args.folder))
    else:
        import importlib

        from bench.kimi_agreement import run_cli
        ours_fn = None
        if args.ours:
            module, _, name = args.ours.partition(":")
            try:
                ours_fn = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError) as e:
                p.error(f"--ours {args.ours!r}: not an importable MODULE:FUNCTION ({e})")
        run_cli(args.folder, args.n, Path(args.out), ours_fn)


if __name__ == "__main__":
    if shutil.which("cmake") is None and sys.argv[1:2] == ["build"]:
        sys.exit("cmake not found: install cmake (apt-get install cmake) to build llama.cpp")
    main()
