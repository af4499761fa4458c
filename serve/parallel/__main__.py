"""``python -m serve.parallel`` (local ranks) and ``torchrun ... -m serve.parallel``: the KCP command line
(:mod:`serve.parallel.cli`)."""
from serve.parallel.cli import main

raise SystemExit(main())
