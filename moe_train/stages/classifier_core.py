"""Domain classifiers of the Gated Adapters recipe (seed 004 Sec. 3, OD-G3): the gates' teacher
during training and the domain predictor of the TAG_CLF / AD_CLF pipelines at inference.

- `TfidfClassifier`: TF-IDF over the source's subword n-grams (ids as words) plus multinomial
  logistic regression, scikit-learn, stored with skops (default trusted types only).
- `EncoderClassifier`: the frozen backbone encoder's mean-pooled source states plus a linear
  head (`probe.fit_probe`, data-parallel); the head is stored as tensors, the encoder is the
  backbone export's.
Both give ``predict_proba(dataset, indices) -> (N, C)``, C = the data's domains in manifest order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from moe_train.errors import CheckpointError, ConfigError
from moe_train.stages.common import StageContext
from moe_train.stages.features import encode_sentences
from moe_train.stages.probe import predict_probs
from moe_train.utils.atomic import atomic_path
from moe_train.utils.safe_load import (check_sklearn_version, dump_skops, load_skops,
                                       load_tensors)


class DomainClassifier(Protocol):
    kind: str

    def predict_proba(self, dataset: Any, indices: np.ndarray) -> np.ndarray: ...


def source_docs(dataset: Any, indices: np.ndarray) -> list[str]:
    """Each source as its subword ids joined by spaces (the TF-IDF "words")."""
    return [" ".join(map(str, dataset.src(int(i)).tolist())) for i in indices]


class TfidfClassifier:
    """TF-IDF (subword n-grams 1..n, sublinear tf) + logistic regression."""

    kind = "tfidf"

    def __init__(self, pipeline: Any, num_domains: int) -> None:
        self.pipeline, self.num_domains = pipeline, num_domains

    @classmethod
    def fit(cls, docs: list[str], labels_N: np.ndarray, num_domains: int, ngrams: int
            ) -> TfidfClassifier:
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline

        present = np.unique(labels_N)
        if len(present) < 2:
            raise ConfigError(f"gated.classifier: tfidf needs sentences of at least two domains "
                              f"in the training split, got {len(present)}; use the encoder "
                              "classifier")
        pipeline = make_pipeline(
            TfidfVectorizer(token_pattern=r"\S+", ngram_range=(1, ngrams), sublinear_tf=True,
                            min_df=2, lowercase=False),
            LogisticRegression(max_iter=1000))
        pipeline.fit(docs, labels_N)
        return cls(pipeline, num_domains)

    def predict_proba(self, dataset: Any, indices: np.ndarray) -> np.ndarray:
        probs = self.pipeline.predict_proba(source_docs(dataset, indices))
        out_NC = np.zeros((len(indices), self.num_domains), np.float32)
        out_NC[:, self.pipeline.classes_] = probs  # a domain absent from training keeps 0
        return out_NC

    def save(self, path: Path) -> None:
        import sklearn

        dump_skops(path, {"pipeline": self.pipeline, "num_domains": self.num_domains,
                          "sklearn_version": sklearn.__version__})

    @classmethod
    def load(cls, path: Path) -> TfidfClassifier:
        state = load_skops(path, (), "TF-IDF domain classifier (skops)")
        if not isinstance(state, dict) or "pipeline" not in state:
            raise CheckpointError(f"{path}: not a TF-IDF domain classifier file; run the "
                                  "classifier stage again")
        check_sklearn_version(path, state.get("sklearn_version"))
        return cls(state["pipeline"], int(state["num_domains"]))


class EncoderClassifier:
    """Mean-pooled states of a (frozen) encoder, then a linear head over the domains."""

    kind = "encoder"

    def __init__(self, model: nn.Module, head: nn.Linear, ctx: StageContext,
                 max_tokens: int) -> None:
        self.model, self.head, self.ctx, self.max_tokens = model, head, ctx, max_tokens

    def features(self, dataset: Any, indices: np.ndarray) -> np.ndarray:
        return encode_sentences(self.model, dataset, indices, self.ctx, self.max_tokens)

    def predict_proba(self, dataset: Any, indices: np.ndarray) -> np.ndarray:
        return predict_probs(self.head, self.features(dataset, indices))

    def save(self, path: Path) -> None:
        with atomic_path(path) as tmp:
            torch.save({k: v.detach().cpu() for k, v in self.head.state_dict().items()}, tmp)

    @staticmethod
    def load_head(path: Path) -> nn.Linear:
        state = load_tensors(path, "the domain classifier's head")
        weight = state.get("weight")
        if weight is None or weight.ndim != 2 or set(state) - {"weight", "bias"}:
            raise CheckpointError(f"{path}: not a linear classifier head (weight, bias)")
        head = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in state)
        head.load_state_dict(state)
        return head.eval()


def domain_report(pred_N: np.ndarray, true_N: np.ndarray, domains: list[str]) -> dict[str, Any]:
    """Micro-F1 (= accuracy for one label per sentence), macro-F1, per-domain F1 and the
    confusion matrix (rows: true domain, columns: predicted) of a domain prediction."""
    from sklearn.metrics import confusion_matrix, f1_score

    labels = list(range(len(domains)))
    per = f1_score(true_N, pred_N, labels=labels, average=None, zero_division=0)
    return {"sentences": int(len(true_N)),
            "micro_f1": float(f1_score(true_N, pred_N, labels=labels, average="micro",
                                       zero_division=0)),
            "macro_f1": float(f1_score(true_N, pred_N, labels=labels, average="macro",
                                       zero_division=0)),
            "f1": {d: float(v) for d, v in zip(domains, per)},
            "misclassified": int((pred_N != true_N).sum()),
            "confusion": {"rows": "true", "columns": "predicted", "domains": domains,
                          "matrix": confusion_matrix(true_N, pred_N, labels=labels).tolist()}}
