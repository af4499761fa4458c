"""Home: what the project is and where each tab lives."""
import streamlit as st

from pages._registry import TABS

st.title("KDA Serve Lab")
st.write(
    "How **Kimi Delta Attention** changes LLM serving, measured live on a real torch engine running on this CPU. "
    "KDA replaces the per-token KV list with a per-sequence state matrix S (per head K × V), updated every token by "
    "decay, a delta-rule correction and a rank-1 write. Kimi models are hybrids: 3 KDA layers per MLA layer. Every "
    "chart in this app is computed by our own code when you open it.")

st.subheader("Tabs")
for tab in TABS:
    st.page_link(tab.path, label=f"{tab.title} — {tab.blurb}", icon=tab.icon)
