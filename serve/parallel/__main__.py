"""``python -m serve.parallel`` (local ranks) and ``torchrun ... -m serve.parallel``: the KCP command line
(:mod:`serve.parallel.cli`).

torch's C++ side logs a failed rendezvous (an unreachable master, a peer that never comes) with a
C++ stack trace on stderr; the command line reports it as one line instead, so those logs are kept to
fatal ones (``TORCH_CPP_LOG_LEVEL``, read when torch loads) unless ``--traceback`` is given or the
variable is already set.
"""
import os
import sys

if "--traceback" not in sys.argv[1:]:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

from serve.parallel.cli import main  # noqa: E402  (after the log level: torch reads it at import)

raise SystemExit(main())
