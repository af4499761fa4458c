"""The model runner's slot paths given requests in any order: ``gather_states`` puts request j's pages in slot
j, ``scatter_states`` / ``scatter_conv`` write slot j back to request j's pages for the slots in ``keep``, in
whatever order ``keep`` lists them, and touch no other request's pages. The engine passes the rows in order and
keeps sorted slot lists, so its output tests never see a mix-up here. Both page policies: a state in one page
per group (unified) and a state spanning several pages (multi_page)."""
from __future__ import annotations

from itertools import islice

import pytest
import torch

from kda_core.layer import KDACache
from serve.config import ServeConfig
from serve.engine.model_runner import ModelRunner
from serve.memory.pages import read_state, write_state
from serve.memory.pool import PageKind, PagePool
from tests.serve.prefix.helpers import tiny_model

NUM_REQUESTS = 4


def setup(policy: str, num_groups: int, state_dtype=torch.float32):
    """A runner, and NUM_REQUESTS requests' state pages (allocated in a shuffled page order, split by group)
    each holding a distinct random state."""
    model = tiny_model()
    config = ServeConfig(16, 16, num_groups=num_groups, page_policy=policy, state_dtype=state_dtype)
    lay0 = config.layout(model.cfg, config.page_bytes(model.cfg))
    pool = PagePool(NUM_REQUESTS * lay0.state_pages + 3, config.page_bytes(model.cfg), poison=True)
    lay = config.layout(model.cfg, pool.page_bytes)
    runner = ModelRunner(model, pool, lay)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(pool.num_pages, generator=gen).tolist()
    states = []
    for r in range(NUM_REQUESTS):
        pages = pool.alloc(PageKind.KDA_STATE, lay.state_pages, r)
        pages = sorted(pages, key=order.index)                             # not in page order
        it = iter(pages)
        sp = [tuple(islice(it, lay.group_pages(g))) for g in range(lay.num_groups)]
        write_state(lay, pool, sp, random_states(model, gen))
        states.append(sp)
    return runner, lay, pool, states


def random_states(model, gen) -> dict:
    cfg = model.cfg
    return {i: KDACache(torch.randn(1, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim, generator=gen),
                        torch.randn(1, cfg.conv_dim, cfg.conv_kernel - 1, generator=gen)) for i in cfg.kda_layers}


def layouts():
    return [pytest.param("unified", 1, id="unified-1group"), pytest.param("unified", 2, id="unified-2groups"),
            pytest.param("multi_page", 1, id="multipage-1group"), pytest.param("multi_page", 2, id="multipage-2groups")]


@pytest.mark.parametrize("policy,groups", layouts())
def test_gather_puts_each_request_in_its_row_slot(policy, groups):
    runner, lay, pool, states = setup(policy, groups)
    rows = [states[i] for i in (2, 0, 3, 1)]
    dense = runner.gather_states(rows)
    for j, sp in enumerate(rows):
        ref = read_state(lay, pool, sp)
        for layer, (rec, conv) in dense.items():
            assert torch.equal(rec[j], ref[layer].recurrent[0]) and torch.equal(conv[j], ref[layer].conv[0]), \
                f"slot {j} does not hold its request's state (layer {layer})"


@pytest.mark.parametrize("keep", [[2, 0], [3, 1, 0], [1, 3, 2, 0]], ids=["2of4", "3of4", "all-reversed"])
@pytest.mark.parametrize("policy,groups", layouts())
@pytest.mark.parametrize("conv_only", [False, True], ids=["state", "conv"])
def test_scatter_writes_each_kept_slot_to_its_own_pages(policy, groups, keep, conv_only):
    """New dense states for every slot; ``keep`` in an unsorted order: each kept slot lands in its request's
    pages (the whole state, or only the conv window with ``scatter_conv``), the others keep their old state."""
    runner, lay, pool, states = setup(policy, groups)
    before = [read_state(lay, pool, sp) for sp in states]
    dense = runner.gather_states(states)
    gen = torch.Generator().manual_seed(5)
    new = {layer: (torch.randn(rec.shape, generator=gen), torch.randn(conv.shape, generator=gen))
           for layer, (rec, conv) in dense.items()}
    (runner.scatter_conv if conv_only else runner.scatter_states)(states, new, list(keep))
    for j, sp in enumerate(states):
        got = read_state(lay, pool, sp)
        for layer, (rec, conv) in new.items():
            if j in keep:
                want_rec = before[j][layer].recurrent[0] if conv_only else rec[j]
                assert torch.equal(got[layer].recurrent[0], want_rec), f"request {j}: recurrent state (layer {layer})"
                assert torch.equal(got[layer].conv[0], conv[j]), f"request {j}: conv window not its slot's (layer {layer})"
            else:
                assert torch.equal(got[layer].recurrent[0], before[j][layer].recurrent[0]), f"request {j} written"
                assert torch.equal(got[layer].conv[0], before[j][layer].conv[0]), f"request {j} written"
