"""Page 04 (RawInputRing): what the text reports equals what the charts draw."""
import re

import pytest

from tests.app.page_helpers import chart_spec, open_page, plotly_values

PAGE = "app_pages/04_raw_input_ring.py"


@pytest.mark.parametrize("values", [{}, {"p04_capacity": 6, "p04_window": 4}], ids=["defaults", "cap6-win4"])
def test_write_backs_text_equals_chart_marks(values):
    """Regression: at defaults the text said "3 forced write-backs" while the chart marked 2 (the
    overflow probe's write-back was counted in the run)."""
    at = open_page(PAGE, **values)
    text = next(m.value for m in at.markdown if "forced write-back" in m.value)
    reported = int(re.search(r"\*\*(\d+) forced write-backs?\*\*", text).group(1))
    crosses = next(t for t in chart_spec(at, "p04_occupancy_chart")["data"] if t["name"].startswith("forced write-back"))
    assert len(plotly_values(crosses.get("x", []))) == reported


def test_full_ring_gets_one_head_tail_label():
    """Regression: with the ring full, separate "head" and "tail" labels were drawn on one slot.
    (Capacity = window = 5 leaves the ring full after the 24-token run, lab.ring.RUN_TOKENS, with the noisy oracle
    at its default p = 0.7: its seeded accept pattern (3, 4, 2, 0, 1, 2, 1, 0, 1) does not depend on the weights,
    as a corrupted draft always differs from the target's token. The default drafter, n-gram, copies the model's
    own output, so whether the ring ends full changed with each export of the shipped weights.)"""
    at = open_page(PAGE, p04_capacity=5, p04_window=5, p04_drafter="noisy oracle")
    labels = [a["text"] for a in chart_spec(at, "p04_slots_chart")["layout"]["annotations"]]
    assert labels == ["head = tail (ring full)"]


def test_window_slider_is_bounded_by_capacity():
    """Dependent widgets constrain each other: a capacity below the window lowers the window instead of
    failing, and a 1-slot ring shows a window of 1 on a disabled slider (kept on the page: a slider that left the
    page came back above its new max and failed, see test_browser)."""
    at = open_page("app_pages/04_raw_input_ring.py")
    at.slider(key="p04_capacity").set_value(4).run()
    assert not at.exception and not at.error
    assert at.slider(key="p04_window").value == 4 and at.slider(key="p04_window").max == 4
    at.slider(key="p04_capacity").set_value(1).run()
    assert not at.exception and not at.error
    window = at.slider(key="p04_window")
    assert window.value == 1 and window.disabled


@pytest.mark.parametrize("width", [64, 128])
def test_timings_say_what_they_timed_when_the_ring_refuses_n(width):
    """With one slot the ring of section 4 refuses a verify of n = 4 drafts at every width (at d = 64 the n-gram
    drafter proposed fewer tokens and the overflow check said "fits"); section 3's bytes and commit timings (rings
    sized for n) say so instead of reading as a contradiction; at the defaults the note is absent."""
    note = "(Measured on rings sized for n = 4, 5 slots: section 4's ring of 1 slot(s) refuses such a verify.)"
    at = open_page(PAGE, p04_capacity=1, p04_width=width)
    at.session_state["p04_timing_on"] = True          # section 3 reads the commit times (its button)
    at.run()
    assert any(m.value.startswith(note) for m in at.markdown)
    assert any(w.value.startswith("Overflow — a verify of n = 4 drafts is refused") for w in at.warning)
    assert not any("Measured on rings" in m.value for m in open_page(PAGE).markdown)


def test_slot_labels_follow_counter_mod_capacity():
    """The text says "slot index = token counter mod capacity": every used slot's label is a counter whose residue
    is that slot (the labels were the tokens' positions in the sequence, prompt included: 45 on slot 3 of 16)."""
    at = open_page(PAGE)
    capacity = next(s.value for s in at.slider if s.key == "p04_capacity")
    bars = chart_spec(at, "p04_slots_chart")["data"][0]
    labelled = [(slot, int(t)) for slot, t in zip(plotly_values(bars["x"]), bars["text"]) if str(t) != ""]
    assert labelled and all(counter % capacity == slot for slot, counter in labelled), labelled


def test_draft_length_offers_only_usable_lengths():
    """A verify of 1 + n tokens must fit the rollback window (at most 16), so the draft slider stops at 15."""
    at = open_page(PAGE)
    draft = next(s for s in at.slider if s.key == "p04_draft")
    window = next(s for s in at.slider if s.key == "p04_window")
    assert draft.max == window.max - 1 == 15
