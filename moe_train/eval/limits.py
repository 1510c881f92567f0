"""Bounds of decoding options that both the config and the command line check (importing this
costs nothing, so `moe-train --help` stays fast)."""

MAX_LENPEN = 10.0
"""Largest length penalty (eval.lenpen, --lenpen): 1024 ** 100 overflows a float (typical
values are 0.6 to 2)."""

MAX_BEAM = 1024
"""Largest beam (eval.beam, --beam): search holds beam x batch x vocabulary scores, and beams
past a few dozen gain nothing in MT (a beam of 100000 only ran out of memory)."""
