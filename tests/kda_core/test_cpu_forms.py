"""``cpu_forms.start_up`` pays every C form's cost at start-up: each form's loader is called."""
from kda_core import cpu_forms, cpu_invariant, cpu_kernel, cpu_mla, cpu_moe, decode_cpu


def test_start_up_loads_every_c_form(monkeypatch):
    called = []
    for module, name in ((cpu_kernel, "backend"), (cpu_invariant, "backend"), (decode_cpu, "load"),
                         (cpu_moe, "backend"), (cpu_mla, "backend")):
        monkeypatch.setattr(module, name, lambda m=module: called.append(m.__name__))
    cpu_forms.start_up()
    assert sorted(called) == sorted(["kda_core.cpu_kernel", "kda_core.cpu_invariant", "kda_core.decode_cpu",
                                     "kda_core.cpu_moe", "kda_core.cpu_mla"])
