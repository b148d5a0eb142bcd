"""`python -m megarl ...` (what torchrun runs: `torchrun --nproc_per_node N -m megarl train`)."""

from megarl.cli import main

raise SystemExit(main())
