"""lab.trained: the trained model's card and Home's prompts, read from the shipped files without torch."""
import json
import subprocess
import sys

from lab.models import TRAINED_WEIGHTS
from lab.trained import home_prompts, model_card
from train.prompts import load_prompts


def test_model_card_is_the_export_manifest():
    m = json.loads((TRAINED_WEIGHTS["demo"] / "manifest.json").read_text())
    card = model_card()
    assert card.name == "kda-demo" and card.num_parameters == m["num_parameters"]
    assert card.code_nats_per_byte == m["quality"]["code"]["nats_per_byte"]
    assert card.code_xz == m["quality"]["code"]["xz_nats_per_byte"] and card.code_nats_per_byte < card.code_xz


def test_home_prompts_are_the_recorded_pair():
    r, p = load_prompts(), home_prompts()
    assert (p.first, p.second, p.continuation) == (r["home"]["first"], r["home"]["second"], r["home"]["continuation"])
    assert p.second.startswith(p.first) and p.cuts_rejected == len(r["rejected"]) == p.cuts_tried - 1
    assert p.continuation_bytes == len(p.continuation.encode())


def test_reading_them_does_not_import_torch():
    """Home reads both at module level; torch loads only with the engine run (fresh-server first render)."""
    code = "import sys, lab.trained as t; t.model_card(); t.home_prompts(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
