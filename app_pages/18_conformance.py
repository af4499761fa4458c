"""18 Conformance: the invariants a recurrent state must keep in a serving engine, ours checked live, llama.cpp's
recorded run, and how to put your own engine through the same checks."""
import streamlit as st

from app_pages.charts import num, show_table
from app_pages.errors import engine_call
from app_pages.links import declare
from app_pages.measurement import remeasure_button, requested
from app_pages.params import Multi
from lab.conformance import (
    AGREEMENT_BENCH,
    CHECK_IDS,
    HOW_TO,
    LLAMA_CPP_BENCH,
    invariants,
    live_run,
    recorded_agreement,
    recorded_llama_cpp,
)
from lab.shipped import missing_note

links = declare(Multi("p18_checks", list(CHECK_IDS), list(CHECK_IDS)))

st.title("Conformance")
st.write(
    "The same few invariants of a recurrent state keep breaking in engines that serve KDA, Gated DeltaNet or Mamba "
    "layers, and no engine's own tests check them from outside. `python -m conformance` does: it drives an engine "
    "through its OpenAI-compatible `/v1/completions` (greedy, logprobs, token-id prompts), toggles what the engine "
    "lets a client toggle (its prefix cache, speculative decoding, the prefill chunk size), and compares greedy "
    "tokens and logprobs. Each check below is one bug class, with the public threads where it broke.")

st.subheader("1 · The invariants and the bugs they come from")
for row in invariants().itertuples():
    st.markdown(f"**{row.title}** (`{row.check}`): {row.invariant}.  \n*Bug class:* {row.bug}.  \n"
                f"*Sources:* {row.sources}")

st.subheader("2 · Our engine, checked live")
st.caption("Our server started in this process once per setting (as deployed, prefix cache off, speculative "
           "decoding, two prefill chunk sizes) with a small pool; short prompts, 6 tokens each. Each check fails "
           "against our engine with a bug of its class put in (tests/conformance/test_suite.py).")


checks = links.multiselect(st, "Checks to run", "p18_checks")


@st.cache_data(show_spinner="Running the checks against our server…", max_entries=4, ttl=3600)
def _p18_live(checks):
    return live_run(checks)


if not checks:
    st.info("Pick at least one check to run.")
elif requested("p18_live_on", "p18_live_button", "Run the checks against our engine",
               "About 15–30 s for all seven on two shared cores."):
    live = engine_call(_p18_live, tuple(checks))
    failed = (live.table["status"] == "fail").sum()
    (st.error if failed else st.success)(f"{len(live.table) - failed} of {len(live.table)} checks pass "
                                         f"({live.seconds:.0f} s; python -m serve.http {live.server}).")
    show_table(live.table, {"check": "Check", "status": "Status", "summary": "Evidence",   # sentences: wrapped
                            "parts pass / fail / n/a": "Parts pass / fail / n/a"}, wrap=True)
    st.download_button("Download the JSON report", live.report_json, file_name="conformance_ours.json",
                       key="p18_json_button")
    remeasure_button(_p18_live, "p18_rerun", "Run again")

st.subheader("3 · llama.cpp on the same weights, recorded")
rec = engine_call(recorded_llama_cpp)
if rec is None:
    st.info(missing_note(LLAMA_CPP_BENCH))
else:
    st.caption(f"llama.cpp {rec.version}, run {rec.date}: `{rec.command}`")
    show_table(rec.table, {"check": "Check", "status": "Status", "summary": "Evidence",
                           "parts pass / fail / n/a": "Parts pass / fail / n/a"}, wrap=True)
    for line in rec.findings:
        st.markdown(f"- {line}")

st.subheader("4 · The same weights in three implementations, recorded")
agree = engine_call(recorded_agreement)
if agree is None:
    st.info(missing_note(AGREEMENT_BENCH))
else:
    st.caption(f"`weights/{agree.model}` run {agree.date[:10]}, fp32, 1 thread: each engine against transformers' "
               "`KimiLinearForCausalLM`, the largest |Δ logprob| of its top 5 tokens over 256 greedy positions, and "
               "where its greedy run first differs.")
    st.caption(agree.versions)
    show_table(agree.table, {"prompt": "Prompt", "tokens": num("Prompt tokens", "%d"),
                             "ours max |Δ logprob|": num("Ours: max |Δ logprob| (nats)", "%.1e"),
                             "ours greedy": "Ours: greedy 256",
                             "llama.cpp max |Δ logprob|": num("llama.cpp: max |Δ logprob| (nats)", "%.1e"),
                             "llama.cpp greedy": "llama.cpp: greedy 256"}, wrap=True)   # 6 columns: last one cut
    st.markdown("What to notice: the three agree to fp32 rounding (ours runs the same maths as transformers in "
                "another summation order). llama.cpp normalises KDA's q and k with eps 1e-5 where fla and transformers "
                "use 1e-6 (`python -m bench.llama_cpp_findings`): on a tiny random model that moved log-probs by about "
                "1e-3 nats and split a greedy run where two experts' router scores nearly tied.")

st.subheader("5 · Put your own engine through it")
for what, cmd in HOW_TO:
    st.markdown(what)
    st.code(cmd, language="bash", wrap_lines=True)   # the vLLM and SGLang commands were cut
st.info("What to notice: a check passes when every compared request gives the same greedy tokens and its "
        "logprobs agree within `--atol` (`--match close` takes vLLM's rule: at the first differing token each "
        "run's token is in the other's top logprobs). A check is n/a when the engine cannot be put in the state it "
        "needs (a start-up setting without `--launch`, no metrics) or the run could not exercise it (no prefix "
        "hit, no draft proposed); the reason says which. Exit status 1 on a failure.")
