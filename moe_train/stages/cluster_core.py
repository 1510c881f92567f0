"""Clustering core of the stage-wise MoA recipe: sentence features -> K cluster labels.

Seed 000 (sec. 4.2, app. 8.2) and seed 001 (app. A.2): sentence features (mean-pooled encoder
states) are reduced with PCA (512 -> 64 dims, no whitening), then clustered into K groups with a
scikit-learn GMM (full covariance, other settings default); seed 001 also compares K-Means and
Birch. By default each feature is first divided by its standard deviation over the sample
(PCA of the correlation matrix): a few high-variance dimensions of Transformer states otherwise
dominate the components, and the clusters follow them rather than the domains (on the synthetic
corpus with a shared vocabulary, PUR 0.74 -> 0.96 with K = 5). The recipe's GMM (moa.whiten,
moa.unit_norm) also whitens the PCA and scales each reduced vector to unit length: the clusters
then follow the direction of a sentence's features rather than their spread or magnitude. Full-
covariance GMM likelihood is unchanged by whitening, but its k-means initialisation is not; and
on the synthetic corpus with a shared vocabulary the most likely 5-component GMM of the plain
PCA features splits sentences by how much of their vocabulary is shared instead of by domain
(three corpus seeds: PUR 0.79-0.97 plain, 0.96-0.97 whitened on the unit sphere, every GMM
seed). Birch's distance threshold and k-means' spherical clusters are worse for it (synthetic
blobs: Birch PUR 1.0 -> 0.74), so the library defaults stay the papers' plain PCA.
The fitted PCA and clusterer are reused unchanged to label any later set (test sets,
distillation data). Cluster quality against known domains is PUR (seed 001 Eq. 11) and NMI.

Pure library: numpy + scikit-learn, no torch.distributed. The stage wrapper runs `fit_clusterer`
on rank 0 and broadcasts the labels.

Cluster ids are canonical: renumbered in order of first appearance over the fitting sample (the
first sentence is in cluster 0, the next sentence outside cluster 0 opens cluster 1, ...), so a
run's labels read the same whatever ids the sklearn model happened to use. Clusters the model
has but the sample never hits (possible with Birch or a collapsed GMM component) take the last
ids, in model order.

Numerics: features are cast to float64 before PCA, so fit and predict run the same arithmetic
whatever dtype the caller passes, and GMM's default ``reg_covar=1e-6`` suffices (in float32 the
Cholesky factorisation of a nearly singular 64 x 64 covariance can fail at that regulariser).
The default is kept, as in the papers; a fit that still fails is a DataError with advice.

Files: `FittedClusterer.save` writes a skops file (no arbitrary objects) holding plain values,
numpy arrays and the fitted PCA / GaussianMixture / KMeans, plus the scikit-learn version;
`load_clusterer` refuses any type outside skops' defaults and `TRUSTED_TYPES`, and a file from
another scikit-learn major.minor release (see utils/safe_load.check_sklearn_version). skops cannot
store Birch's CF tree, so a fitted Birch is kept as what its ``predict`` uses: the subcluster
centres and their labels (`SubclusterPredictor`, same predictions).

Shape legend: N sentences, D feature dim, P PCA dims (min(pca_dim, D, N)), K clusters,
C domains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import sklearn
from sklearn.cluster import Birch, KMeans
from sklearn.decomposition import PCA
from sklearn.metrics import pairwise_distances_argmin
from sklearn.mixture import GaussianMixture

from moe_train.errors import CheckpointError, ConfigError, DataError
from moe_train.eval.routing_stats import expert_purity, normalized_mutual_info
from moe_train.utils.safe_load import check_sklearn_version, dump_skops, load_skops

FORMAT_VERSION = 4  # 3: scale_D (standardised features); 4: unit_norm
"""Version of the clusterer file (2: skops); bumped when its fields change."""
TRUSTED_TYPES: tuple[str, ...] = ()
"""Types a clusterer file may hold beyond skops' defaults (builtins, numpy, scikit-learn
estimators): none. Anything else makes `load_clusterer` refuse the file before building it."""


@dataclass
class SubclusterPredictor:
    """A fitted Birch reduced to its ``predict``: the label of the nearest subcluster centre."""

    centers_SP: np.ndarray
    """Subcluster centres (Birch ``subcluster_centers_``), float64."""
    labels_S: np.ndarray
    """Cluster id of each subcluster (Birch ``subcluster_labels_``), int64."""

    @classmethod
    def from_birch(cls, birch: Birch) -> "SubclusterPredictor":
        return cls(np.asarray(birch.subcluster_centers_, dtype=np.float64),
                   np.asarray(birch.subcluster_labels_, dtype=np.int64))

    def predict(self, x_NP: np.ndarray) -> np.ndarray:
        return self.labels_S[pairwise_distances_argmin(x_NP, self.centers_SP)]


MODEL_TYPES: dict[str, type] = {"gmm": GaussianMixture, "kmeans": KMeans,
                                "birch": SubclusterPredictor}
"""Clusterer name -> type of `FittedClusterer.model` (checked on load)."""

CLUSTERERS: dict[str, Callable[[int, int, int], Any]] = {
    # seed 000 app. 8.2: covariance 'full', other settings default but the initialisations:
    # one EM run (sklearn's default) lands in a poor local optimum often enough to cost 0.1 PUR
    "gmm": lambda k, seed, inits: GaussianMixture(n_components=k, covariance_type="full",
                                                  n_init=inits, random_state=seed),
    # n_init=10: the scikit-learn default when the papers were written ("auto" now means 1 run)
    "kmeans": lambda k, seed, inits: KMeans(n_clusters=k, n_init=max(inits, 10),
                                            random_state=seed),
    # deterministic; the final step is agglomerative clustering of the CF subclusters into K
    "birch": lambda k, seed, inits: Birch(n_clusters=k),
}
"""Clusterer name (``moa.clusterer``) -> factory (num_clusters, seed, initialisations) ->
unfitted sklearn model with ``fit`` and ``predict``."""


@dataclass
class FittedClusterer:
    """A fitted PCA + clusterer pair and the canonical renumbering of its cluster ids."""

    pca: PCA
    """Fitted on the sample; reduces D -> `dims` dims (whitened if fitted with `whiten`)."""
    model: Any
    """Fitted clusterer on the PCA features: GaussianMixture, KMeans or (Birch)
    SubclusterPredictor, as `MODEL_TYPES` says."""
    method: str
    """Key of CLUSTERERS."""
    num_clusters: int
    """K; canonical labels are in [0, K)."""
    dims: int
    """P, the PCA output dims."""
    label_map_K: np.ndarray
    """Model cluster id -> canonical id (a permutation of 0..K-1), int64."""
    fit_sizes_K: np.ndarray
    """Sentences of the fitting sample per canonical cluster, int64 (zeros: empty clusters)."""
    scale_D: np.ndarray
    """Each feature is divided by this before PCA: its standard deviation over the fitting
    sample (`standardize`), else ones. float64."""
    unit_norm: bool
    """Each PCA vector is scaled to unit length before the clusterer sees it."""

    @property
    def input_dim(self) -> int:
        """D, the feature dim the PCA was fitted on."""
        return int(self.pca.n_features_in_)

    def predict(self, features_ND: np.ndarray) -> np.ndarray:
        """Canonical cluster labels_N (int64) of any feature set with the fitting sample's D."""
        x_ND = _as_features(features_ND, expect_dim=self.input_dim)
        if x_ND.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        raw_N = np.asarray(self.model.predict(self.project(x_ND)), dtype=np.int64)
        return self.label_map_K[raw_N]

    def project(self, features_ND: np.ndarray) -> np.ndarray:
        """The clusterer's input, z_NP: scaled, PCA-reduced and (`unit_norm`) unit-length."""
        return _project(self.pca.transform(features_ND / self.scale_D), self.unit_norm)

    def save(self, path: str | Path) -> None:
        """Write a skops file to `path` atomically (a reader never sees a half-written file)."""
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        if isinstance(self.model, SubclusterPredictor):
            state["model"] = {"centers_SP": self.model.centers_SP,
                              "labels_S": self.model.labels_S}
        state["format_version"] = FORMAT_VERSION
        state["sklearn_version"] = sklearn.__version__
        dump_skops(path, state)


def load_clusterer(path: str | Path) -> FittedClusterer:
    """Read a clusterer written by `FittedClusterer.save` (skops, trusted types only, same
    scikit-learn minor release); a missing, unreadable, untrusted or malformed file is a one-line
    CheckpointError naming it."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: clusterer file not found; run the cluster stage first")
    state = load_skops(path, TRUSTED_TYPES, "clusterer file (skops)")
    version = state.get("format_version") if isinstance(state, dict) else None
    if not isinstance(version, (int, str)) or version != FORMAT_VERSION:
        found = state.get("format_version") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(f"{path}: not a clusterer file of format {FORMAT_VERSION} "
                              f"(found {found!r}); run the cluster stage again")
    names = [f.name for f in fields(FittedClusterer)]
    missing = [n for n in names if n not in state]
    if missing or not isinstance(state["method"], str) or state["method"] not in MODEL_TYPES:
        what = f"missing {', '.join(missing)}" if missing else f"method {state['method']!r}"
        raise CheckpointError(f"{path}: malformed clusterer file ({what}); "
                              "run the cluster stage again")
    check_sklearn_version(path, state.get("sklearn_version"))
    if state["method"] == "birch" and isinstance(state["model"], dict) \
            and set(state["model"]) == {"centers_SP", "labels_S"}:
        state["model"] = SubclusterPredictor(**state["model"])
    expected = {"pca": PCA, "model": MODEL_TYPES[state["method"]], "label_map_K": np.ndarray,
                "fit_sizes_K": np.ndarray, "scale_D": np.ndarray, "unit_norm": bool}
    wrong = [f"{k} is a {type(state[k]).__name__}, expected {t.__name__}"
             for k, t in expected.items() if not isinstance(state[k], t)]
    if wrong:
        raise CheckpointError(f"{path}: malformed clusterer file ({'; '.join(wrong)}); "
                              "run the cluster stage again")
    return FittedClusterer(**{n: state[n] for n in names})


def fit_clusterer(features_ND: np.ndarray, num_clusters: int, method: str = "gmm",
                  pca_dim: int = 64, seed: int = 0, standardize: bool = True,
                  inits: int = 5, whiten: bool = False, unit_norm: bool = False
                  ) -> FittedClusterer:
    """Fit PCA to min(pca_dim, D, N) dims, fewer where the rest carry no variance (of the
    features divided by their standard deviation when `standardize`; whitened when `whiten`;
    each vector scaled to unit length when `unit_norm`), then the `method` clusterer with
    K = num_clusters on the N sampled sentence features (the best of `inits` initialisations
    by likelihood for gmm, of at least 10 for kmeans); cluster ids are made canonical (module
    docstring)."""
    if method not in CLUSTERERS:
        raise ConfigError(f"moa.clusterer: unknown clusterer {method!r} "
                          f"(known: {', '.join(sorted(CLUSTERERS))})")
    if isinstance(num_clusters, bool) or not isinstance(num_clusters, (int, np.integer)) \
            or num_clusters < 2:
        raise ConfigError(f"moa.num_clusters: expected an integer >= 2, got {num_clusters!r}")
    if isinstance(pca_dim, bool) or not isinstance(pca_dim, (int, np.integer)) or pca_dim < 1:
        raise ConfigError(f"moa.pca_dim: expected a positive integer, got {pca_dim!r}")
    x_ND = _as_features(features_ND)
    N, D = x_ND.shape
    K = int(num_clusters)
    if K > N:
        raise ConfigError(f"moa.num_clusters: expected at most the N={N} sampled sentences, "
                          f"got {K}; sample more sentences or use fewer clusters")
    P = min(int(pca_dim), D, N)
    scale_D = np.ones(D)
    if standardize:
        std_D = x_ND.std(axis=0)
        scale_D = np.where(std_D > 1e-12, std_D, 1.0)
    pca = PCA(n_components=P, whiten=bool(whiten), random_state=seed)
    z_NP = _project(pca.fit_transform(x_ND / scale_D), bool(unit_norm))
    # Directions without variance (an affine LayerNorm leaves the features in D - 1 dims):
    # whitening would scale their rounding noise up to unit variance and into every vector
    kept = int(np.count_nonzero(pca.explained_variance_ > 1e-9 * pca.explained_variance_[0]))
    if 0 < kept < P:
        P = kept
        pca = PCA(n_components=P, whiten=bool(whiten), random_state=seed)
        z_NP = _project(pca.fit_transform(x_ND / scale_D), bool(unit_norm))
    model = CLUSTERERS[method](K, seed, int(inits))
    try:
        model.fit(z_NP)
    except ValueError as exc:  # e.g. GMM: "ill-defined empirical covariance"
        raise DataError(f"cluster features: {method} failed on the {N} sampled sentences "
                        f"({_first_line(exc)}); sample more (or more varied) sentences, lower "
                        "moa.num_clusters or change moa.clusterer") from None
    if isinstance(model, Birch):
        model = SubclusterPredictor.from_birch(model)  # what predict uses; skops-storable
    raw_N = np.asarray(model.predict(z_NP), dtype=np.int64)
    label_map_K = _first_appearance_map(raw_N, K)
    labels_N = label_map_K[raw_N]
    return FittedClusterer(pca=pca, model=model, method=method, num_clusters=K, dims=P,
                           label_map_K=label_map_K,
                           fit_sizes_K=np.bincount(labels_N, minlength=K).astype(np.int64),
                           scale_D=scale_D, unit_norm=bool(unit_norm))


def cluster_report(labels_N: np.ndarray, domains_N: np.ndarray, domain_names: list[str],
                   num_clusters: int | None = None) -> dict[str, Any]:
    """PUR (seed 001 Eq. 11), NMI (arithmetic normalisation, as sklearn's
    normalized_mutual_info_score) and the cluster x domain count table of labelled sentences.

    Rows are clusters 0..K-1 (K = `num_clusters`, or max label + 1), columns the domains in
    `domain_names` order. JSON-serialisable.
    """
    labels_N = np.asarray(labels_N).reshape(-1)
    domains_N = np.asarray(domains_N).reshape(-1)
    if labels_N.shape != domains_N.shape:
        raise ValueError(f"cluster_report: {labels_N.size} labels but {domains_N.size} domains")
    C = len(domain_names)
    if labels_N.size and labels_N.min() < 0:
        raise ValueError("cluster_report: cluster labels must be non-negative")
    K = int(labels_N.max()) + 1 if labels_N.size else 0
    if num_clusters is not None:
        if K > num_clusters:
            raise ValueError(f"cluster_report: label {K - 1} but num_clusters={num_clusters}")
        K = int(num_clusters)
    if domains_N.size and (domains_N.min() < 0 or domains_N.max() >= C):
        raise DataError(f"cluster report: domain ids span [{int(domains_N.min())}, "
                        f"{int(domains_N.max())}] but {C} domain names are given "
                        f"({', '.join(domain_names)})")
    flat = labels_N.astype(np.int64) * C + domains_N.astype(np.int64)
    table_KC = np.bincount(flat, minlength=K * C).reshape(K, C)
    return {
        "pur": expert_purity(table_KC),
        "nmi": normalized_mutual_info(table_KC),
        "sentences": int(labels_N.size),
        "num_clusters": K,
        "domains": list(domain_names),
        "cluster_sizes": table_KC.sum(1).tolist(),
        "table": table_KC.tolist(),
    }


# ----------------------------------------------------------------------------------- helpers
def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"


def _project(z_NP: np.ndarray, unit_norm: bool) -> np.ndarray:
    """`z_NP`, each row scaled to unit length if `unit_norm` (an all-zero row stays zero)."""
    if not unit_norm:
        return z_NP
    norm_N1 = np.linalg.norm(z_NP, axis=1, keepdims=True)
    return z_NP / np.where(norm_N1 > 1e-12, norm_N1, 1.0)


def _as_features(features_ND: np.ndarray, expect_dim: int | None = None) -> np.ndarray:
    """float64 (N, D) copy-if-needed of the features; non-finite values are a DataError."""
    x_ND = np.asarray(features_ND, dtype=np.float64)
    if x_ND.ndim != 2:
        raise ValueError(f"cluster features: expected an (N, D) array, got shape {x_ND.shape}")
    if expect_dim is not None and x_ND.shape[1] != expect_dim:
        raise DataError(f"cluster features: expected dim {expect_dim} (the dim the clusterer "
                        f"was fitted on), got {x_ND.shape[1]}; features and clusterer come from "
                        "different backbones")
    finite_N = np.isfinite(x_ND).all(axis=1)
    if not finite_N.all():
        bad = np.flatnonzero(~finite_N)
        raise DataError(f"cluster features: {bad.size} of {x_ND.shape[0]} sentences have "
                        f"non-finite values (NaN/inf), first at row {int(bad[0])}; expected "
                        "finite encoder features")
    return x_ND


def _first_appearance_map(raw_N: np.ndarray, K: int) -> np.ndarray:
    """Model id -> canonical id: ids seen in `raw_N` numbered by first appearance, then the
    unseen ids in model order."""
    if raw_N.size and (raw_N.min() < 0 or raw_N.max() >= K):
        raise RuntimeError(f"clusterer returned ids outside [0, {K}): "
                           f"[{int(raw_N.min())}, {int(raw_N.max())}]")
    seen, first_idx = np.unique(raw_N, return_index=True)
    order = seen[np.argsort(first_idx)]
    label_map_K = np.full(K, -1, dtype=np.int64)
    label_map_K[order] = np.arange(order.size)
    unseen = np.flatnonzero(label_map_K < 0)
    label_map_K[unseen] = np.arange(order.size, K)
    return label_map_K
