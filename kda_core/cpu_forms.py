"""Every C form this process may run, built (once per machine), loaded and self-checked at start-up:
:func:`start_up`. Each form is also chosen on its first use, so calling this is only about WHEN the cost is paid:
a server calls it before it takes its first request (``serve/http/__main__.py``, ``streamlit_app.py``, ``app.py``).

The forms: the fused chunk kernel of prefill (:mod:`kda_core.cpu_kernel`), the row-invariant GEMM under every
linear (:mod:`kda_core.cpu_invariant`, chosen once per process before any linear runs), the fused KDA decode layer
(:mod:`kda_core.decode_cpu`; its self-check runs per shape at first use), the MoE feed-forward in one call
(:mod:`kda_core.cpu_moe`) and the absorbed MLA decode (:mod:`kda_core.cpu_mla`). A form that cannot run here
(no compiler, ``KDA_CPU_KERNEL=0``, ``KDA_CPU_GEMM=0``, a failed self-check) leaves its torch form in place;
each module's ``reason()`` (or ``backend()`` being None) says why.
"""
from __future__ import annotations


def start_up() -> None:
    """Build / load / self-check every C form (see the module docstring); never raises for a form that cannot run."""
    from kda_core import cpu_invariant, cpu_kernel, cpu_mla, cpu_moe, decode_cpu

    cpu_kernel.backend()
    cpu_invariant.backend()
    decode_cpu.load()
    cpu_moe.backend()
    cpu_mla.backend()
