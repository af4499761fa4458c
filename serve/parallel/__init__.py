"""KDA context parallel (KCP): one prompt across real ``torch.distributed`` ranks (page 10).

| concept | file | main type / function | tests |
|---|---|---|---|
| block summary (M, S_ext), fold | ``summary.py`` | ``BlockSummary``, ``chunk_summary``, ``naive_summary`` | ``tests/serve/parallel/test_kcp_summary.py`` |
| per-rank algorithm, two variants | ``kcp.py`` | ``kcp_kda``, ``exchange_bytes`` (+ ``python -m serve.parallel``) | ``test_kcp.py`` |
| layer prefill with the conv halo | ``halo.py`` | ``kcp_layer_prefill``, ``fold_halo`` | ``test_kcp_halo.py`` |
| counted collectives, phase clock | ``comm.py`` | ``Comm``, ``PhaseTimes`` | (through the above) |
| starting ranks on this machine | ``launch.py`` | ``run_ranks``, ``check_backend``, ``check_timeout`` | ``test_kcp_launch.py`` |
| joining a torchrun job | ``torchrun.py`` | ``torchrun_env``, ``init_from_env`` | ``test_kcp_launch.py`` |
| cores and memory this host gives | ``host.py`` | ``host_limits``, ``HostLimits`` | ``test_kcp_hosted.py`` |
| one run: config, rank job | ``run.py`` | ``KCPConfig``, ``run_kcp``, ``KCPRun`` | ``test_kcp.py``, ``test_kcp_halo.py`` |
| memory a rank needs vs the machine | ``memory.py`` | ``rank_bytes``, ``check_rank_memory`` | ``test_kcp_launch.py`` |
| seeded inputs per token range | ``inputs.py`` | ``kda_inputs``, ``layer_inputs`` | (through the above) |
| command line | ``cli.py`` | ``main`` | serve/README.md commands |

Page 10's numbers and projection (``compare_with``, ``project``, ``bytes_vs_context``) are experiments on this
layer: ``lab/kcp.py``, tested in ``tests/lab/test_kcp.py``.
"""
