"""The efficiency table of the Gated Adapters recipe (seed 004 Sec. 4.2, Table 7).

Each system translates each domain's test sentences on its own (greedy, ``gated.
efficiency_batch`` sentences per batch); times and counts are summed over the domains and given
as sentences/s and tokens/s. Tokens are the references' subword tokens, a count every system
shares (as in 004, whose rows all give 23.74 tokens per sentence). AD_CLF's time includes its
classifier predicting the domains of the same sentences. All systems are timed in one run, in
``gated.efficiency_repeats`` rounds whose system order rotates; each (system, domain) keeps its
fastest round, so a background hiccup does not decide a ratio. Before the first round every
system translates one batch untimed, so first-call costs (allocations, kernel set-up) fall on
no system's time, even with one round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

Translate = Callable[[np.ndarray], Any]
"""Translate these test indices (the system's whole pipeline)."""


def efficiency_table(systems: dict[str, Translate], by_domain: dict[str, np.ndarray],
                     tokens_N: np.ndarray, repeats: int,
                     warmup: np.ndarray | None = None) -> dict[str, Any]:
    """{system: {sentences_per_s, tokens_per_s, seconds, domains: {...}}} plus the ratios of
    004 Table 7 when its systems are present. `warmup`: sentences each system translates once,
    untimed, before the rounds."""
    names = list(systems)
    if warmup is not None and len(warmup):
        for s in names:
            systems[s](warmup)
    best = {(s, d): float("inf") for s in names for d in by_domain}
    for r in range(repeats):
        for s in names[r % len(names):] + names[:r % len(names)]:
            for d, idx in by_domain.items():
                start = time.perf_counter()
                systems[s](idx)
                best[s, d] = min(best[s, d], time.perf_counter() - start)
    table: dict[str, Any] = {}
    rate: dict[str, float] = {}
    for s in names:
        rows = {d: _rates(len(idx), int(tokens_N[idx].sum()), best[s, d])
                for d, idx in by_domain.items()}
        seconds = sum(best[s, d] for d in by_domain)
        total = _rates(sum(len(i) for i in by_domain.values()),
                       int(sum(tokens_N[i].sum() for i in by_domain.values())), seconds)
        table[s] = total | {"domains": rows}
        rate[s] = total["sentences"] / seconds if seconds else 0.0
    ratios = {}
    for a, b in (("GAD", "AD_CLF"), ("GAD", "AD_ORACLE"), ("AD_CLF", "AD_ORACLE")):
        if rate.get(a) and rate.get(b):
            ratios[f"{a}/{b}"] = round(rate[a] / rate[b], 3)
    return {"systems": table, "sentences_per_s_ratios": ratios, "repeats": repeats}


def _rates(sentences: int, tokens: int, seconds: float) -> dict[str, float]:
    return {"sentences": sentences, "tokens": tokens, "seconds": round(seconds, 4),
            "sentences_per_s": round(sentences / seconds, 2) if seconds else 0.0,
            "tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0}
