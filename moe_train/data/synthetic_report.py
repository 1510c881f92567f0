"""How hard a synthetic corpus makes domain knowledge (``difficulty`` in its domains.json).

- ``bow_domain_accuracy``: a bag-of-words logistic-regression domain classifier trained on the
  training sources, scored on the held-out ones (test, else dev). Near 1.0: domains are
  trivially separable from words alone, so clustering them proves little.
- ``wrong_domain_bleu``: BLEU of the generator's own translation of the held-out sources made
  as if each sentence belonged to the next domain, against the true references. 100 minus it
  is what knowing the domain is worth to a perfect translator (0 gap: domains do not matter).
The BLEU gap between a backbone and an oracle-domain adapter model, the other half of the
difficulty, needs trained models: benchmarks/moa_synthetic.py records it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from moe_train.data.synthetic_grammar import SOURCE_LANG, translate


def _pair(lang: str) -> str:
    return "-".join(sorted((SOURCE_LANG, lang)))


def _read(corpus: Path, domain: str, lang: str, split: str, side: str) -> list[str]:
    path = corpus / domain / f"{domain}.{_pair(lang)}.{split}.{side}"
    return path.read_text(encoding="utf-8").splitlines() if path.is_file() else []


def difficulty(corpus: str | Path, domains: Sequence[str], lang: str,
               ambiguous: int | None = None) -> dict[str, Any]:
    """The corpus's difficulty figures (see the module docstring); {} without held-out data."""
    import sacrebleu
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.linear_model import LogisticRegression

    from moe_train.data.synthetic import AMBIGUOUS, tokenize

    corpus = Path(corpus)
    held = "test" if _read(corpus, domains[0], lang, "test", SOURCE_LANG) else "dev"
    train_x, train_y, test_x, test_y, refs = [], [], [], [], []
    for d, domain in enumerate(domains):
        src = _read(corpus, domain, lang, "train", SOURCE_LANG)
        train_x += src
        train_y += [d] * len(src)
        held_src = _read(corpus, domain, lang, held, SOURCE_LANG)
        test_x += held_src
        test_y += [d] * len(held_src)
        refs += _read(corpus, domain, lang, held, lang)
    if not test_x or len(domains) < 2:
        return {}
    vec = CountVectorizer(token_pattern=r"[^\s.,?]+", lowercase=False)
    clf = LogisticRegression(max_iter=2000).fit(vec.fit_transform(train_x), train_y)
    accuracy = float((clf.predict(vec.transform(test_x)) == test_y).mean())
    n_ambiguous = len(AMBIGUOUS) if ambiguous is None else ambiguous
    wrong = [translate(tokenize(s), domains[(d + 1) % len(domains)], lang, n_ambiguous)
             for s, d in zip(test_x, test_y)]
    tok_refs = [tokenize(r) for r in refs]
    bleu = sacrebleu.corpus_bleu(wrong, [tok_refs], tokenize="none", force=True).score
    return {"held_out_split": held, "sentences": len(test_x),
            "bow_domain_accuracy": round(accuracy, 4), "wrong_domain_bleu": round(bleu, 2)}
