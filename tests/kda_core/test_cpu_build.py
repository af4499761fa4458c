"""kda_core.cpu_build: which vector paths a CPU runs (from its /proc/cpuinfo flags), the CPU's vector width, the
path KDA_CPU_ISA forces, and the library built for each path this host runs reports that path's width."""
import ctypes
import os

import pytest

from kda_core import cpu_build
from kda_core.cpu_build import ISAS, cpu_vector_bits, default_isa, host_isas

ZEN3 = {"sse2", "avx", "avx2", "fma"}                      # an AVX2-only EPYC
ZEN4 = ZEN3 | {"avx512f", "avx512dq", "avx512vl"}          # this machine's kind


@pytest.mark.parametrize("flags,paths,bits", [(ZEN4, ["avx512", "avx2"], 512), (ZEN3, ["avx2"], 256),
                                              ({"sse2", "avx"}, [], 256), ({"sse2"}, [], 128)],
                         ids=["avx512", "avx2-only", "avx-no-fma", "sse2"])
def test_paths_and_width_from_the_flags(flags, paths, bits, monkeypatch):
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "x86_64")
    assert host_isas(flags) == paths and cpu_vector_bits(flags) == bits


def test_default_is_the_widest_unless_forced(monkeypatch):
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: set(ZEN4))
    monkeypatch.delenv("KDA_CPU_ISA", raising=False)
    assert default_isa() == "avx512"
    monkeypatch.setenv("KDA_CPU_ISA", "avx2")
    assert default_isa() == "avx2"
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: set(ZEN3))
    monkeypatch.setenv("KDA_CPU_ISA", "avx512")
    with pytest.raises(RuntimeError, match="KDA_CPU_ISA=avx512 but this CPU lacks avx512f"):
        default_isa()
    monkeypatch.delenv("KDA_CPU_ISA")
    assert default_isa() == "avx2"
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: {"sse2"})
    with pytest.raises(RuntimeError, match="AVX2 and FMA"):
        default_isa()


@pytest.mark.skipif(os.environ.get("KDA_CPU_KERNEL") == "0", reason="turned off by KDA_CPU_KERNEL=0")
@pytest.mark.parametrize("isa", [pytest.param(i, marks=pytest.mark.skipif(i not in host_isas(), reason=f"no {i} here"))
                                 for i in ISAS])
def test_each_path_builds_a_library_of_its_width(isa):
    path = cpu_build.build(isa)
    lib = ctypes.CDLL(str(path))
    assert lib.kda_vector_bits() == ISAS[isa].vector_bits and f"-{isa}-" in path.name


@pytest.mark.skipif(os.environ.get("KDA_CPU_KERNEL") == "0", reason="turned off by KDA_CPU_KERNEL=0")
@pytest.mark.skipif("avx2" not in host_isas(), reason="no AVX2 here")
def test_open_library_refuses_a_library_of_another_width():
    """A library opened as a path it was not built for (its vector width differs) is refused, naming both widths."""
    path = cpu_build.build("avx2")
    assert cpu_build.open_library(path, "avx2", "kda_vector_bits").kda_vector_bits() == 256
    other = next(i for i in ISAS if ISAS[i].vector_bits != 256)
    with pytest.raises(RuntimeError, match=r"runs 256-bit vectors, not .*built without its flags"):
        cpu_build.open_library(path, other, "kda_vector_bits")


def test_a_changed_header_builds_again(tmp_path, monkeypatch):
    """A library is rebuilt when a header beside its source changes (moe_cpu.c and mla_cpu.c include
    cephes_exp.h): the cache key covers the headers, else the old library would load with the old function."""
    monkeypatch.setenv("KDA_KERNEL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "one.c"
    src.write_text('#include "value.h"\nint one_value(void) { return VALUE; }\n')
    (tmp_path / "value.h").write_text("#define VALUE 1\n")
    first = cpu_build.build(default_isa(), src)
    (tmp_path / "value.h").write_text("#define VALUE 2\n")
    second = cpu_build.build(default_isa(), src)
    assert first != second
    assert ctypes.CDLL(str(second)).one_value() == 2
