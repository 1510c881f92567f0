"""`python -m moe_train ...` (also what `deepspeed --module moe_train` runs)."""

from moe_train.cli import main

raise SystemExit(main())
