"""Clustering core: blob recovery per method, held-out prediction, canonical ids, save/load,
PCA dims, PUR/NMI report, and every user error with its message."""

from __future__ import annotations

import functools
import zipfile
from dataclasses import fields

import numpy as np
import pytest
import skops.io as sio
import sklearn
from sklearn.cluster import Birch
from sklearn.decomposition import PCA
from sklearn.metrics import normalized_mutual_info_score

from moe_train.errors import CheckpointError, ConfigError, DataError
from moe_train.stages.cluster_core import (CLUSTERERS, FORMAT_VERSION, FittedClusterer,
                                           SubclusterPredictor, _first_appearance_map,
                                           cluster_report, fit_clusterer, load_clusterer)

C, D = 5, 32  # domains, feature dim
DOMAINS = ["it", "law", "med", "news", "subs"]
METHODS = sorted(CLUSTERERS)


def blobs(per_domain: int, seed: int, centers_CD: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unit-variance Gaussian blobs around `centers_CD`, rows shuffled; (features_ND, domains_N)."""
    rng = np.random.default_rng(seed)
    domains_N = rng.permutation(np.repeat(np.arange(C), per_domain))
    x_ND = centers_CD[domains_N] + rng.normal(0.0, 1.0, (domains_N.size, D))
    return x_ND.astype(np.float32), domains_N


@pytest.fixture(scope="module")
def data() -> dict[str, np.ndarray]:
    # centers ~48 apart, blob radius ~6: any sane clusterer separates them
    centers_CD = np.random.default_rng(123).normal(0.0, 6.0, (C, D))
    x, dom = blobs(100, 0, centers_CD)
    x_held, dom_held = blobs(40, 1, centers_CD)
    return {"x": x, "dom": dom, "x_held": x_held, "dom_held": dom_held}


@pytest.fixture(scope="module")
def fitted(data: dict[str, np.ndarray]) -> dict[str, FittedClusterer]:
    return {m: fit_clusterer(data["x"], C, method=m, pca_dim=64, seed=0) for m in METHODS}


def first_appearance_order(labels_N: np.ndarray) -> list[int]:
    return [int(v) for v in dict.fromkeys(labels_N.tolist())]


# ------------------------------------------------------------------------------ behaviour
@pytest.mark.parametrize("method", METHODS)
def test_each_method_recovers_blobs(method, data, fitted):
    f = fitted[method]
    labels_N = f.predict(data["x"])
    report = cluster_report(labels_N, data["dom"], DOMAINS, num_clusters=C)
    assert report["pur"] >= 0.95 and report["nmi"] >= 0.9
    assert labels_N.dtype == np.int64 and labels_N.shape == (data["x"].shape[0],)
    assert f.method == method and f.num_clusters == C
    assert f.fit_sizes_K.tolist() == np.bincount(labels_N, minlength=C).tolist()


@pytest.mark.parametrize("method", METHODS)
def test_predict_held_out_points_joins_their_blobs_cluster(method, data, fitted):
    f = fitted[method]
    train_N = f.predict(data["x"])
    # the cluster each domain's training points mostly fell in
    cluster_of_C = np.array([np.bincount(train_N[data["dom"] == c], minlength=C).argmax()
                             for c in range(C)])
    assert sorted(cluster_of_C.tolist()) == list(range(C))  # one cluster per blob
    np.testing.assert_array_equal(f.predict(data["x_held"]), cluster_of_C[data["dom_held"]])


def test_canonical_ids_follow_first_appearance(data, fitted):
    dom = data["dom"]
    # with separable blobs, cluster == domain renumbered by the domain's first row
    expected_N = _first_appearance_map(dom, C)[dom]
    assert first_appearance_order(expected_N) == list(range(C))
    for method in METHODS:
        np.testing.assert_array_equal(fitted[method].predict(data["x"]), expected_N)
    # other seeds, other sklearn ids, same canonical labels
    again = fit_clusterer(data["x"], C, method="gmm", seed=7)
    np.testing.assert_array_equal(again.predict(data["x"]), expected_N)


def test_first_appearance_map_by_hand():
    # raw ids 2, 0, 3 appear in that order; unseen 1 and 4 follow in model order
    np.testing.assert_array_equal(_first_appearance_map(np.array([2, 2, 0, 3, 0]), 5),
                                  [1, 3, 0, 2, 4])
    np.testing.assert_array_equal(_first_appearance_map(np.array([1, 0]), 2), [1, 0])


def test_first_rows_set_the_numbering(data):
    # put one row of domains 3, 1, 4, 0, 2 first: their clusters must be 0, 1, 2, 3, 4
    dom, x = data["dom"], data["x"]
    first = [int(np.flatnonzero(dom == c)[0]) for c in (3, 1, 4, 0, 2)]
    order = first + [i for i in range(dom.size) if i not in first]
    f = fit_clusterer(x[order], C, method="kmeans")
    assert f.predict(x[order])[:5].tolist() == [0, 1, 2, 3, 4]
    assert f.predict(x[first]).tolist() == [0, 1, 2, 3, 4]


def test_float32_and_float64_inputs_agree(data, fitted):
    f = fitted["gmm"]
    np.testing.assert_array_equal(f.predict(data["x_held"]),
                                  f.predict(data["x_held"].astype(np.float64)))
    assert f.predict(np.zeros((0, D))).shape == (0,)


def test_save_load_round_trip(tmp_path, data, fitted):
    for method in METHODS:
        path = tmp_path / "sub" / f"{method}.skops"
        fitted[method].save(path)
        assert zipfile.is_zipfile(path)  # a skops archive
        loaded = load_clusterer(path)
        assert (loaded.method, loaded.num_clusters, loaded.dims) == (method, C, D)
        assert type(loaded.model) is type(fitted[method].model)
        np.testing.assert_array_equal(loaded.label_map_K, fitted[method].label_map_K)
        np.testing.assert_array_equal(loaded.predict(data["x_held"]),
                                      fitted[method].predict(data["x_held"]))
    # atomic write: only the final files, no temporaries left beside them
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == [f"{m}.skops" for m in METHODS]


def test_birch_is_kept_as_its_predictor(data):
    # the stored form predicts exactly what the fitted Birch predicts
    z_NP = _pca_features(data["x"])
    birch = Birch(n_clusters=C).fit(z_NP)
    kept = SubclusterPredictor.from_birch(birch)
    held = _pca_features(data["x"], data["x_held"])
    np.testing.assert_array_equal(kept.predict(held), birch.predict(held))
    np.testing.assert_array_equal(kept.predict(z_NP), birch.predict(z_NP))


def _pca_features(x_fit: np.ndarray, x: np.ndarray | None = None) -> np.ndarray:
    """`x` (default: `x_fit`) in 8 PCA dims fitted on `x_fit`."""
    pca = PCA(n_components=8, random_state=0).fit(x_fit.astype(np.float64))
    return pca.transform((x_fit if x is None else x).astype(np.float64))


# 6 centred points span 5 dims: the sixth component has no variance and is left out
@pytest.mark.parametrize("n, d, pca_dim, dims", [(60, 8, 64, 8), (6, 8, 64, 5), (60, 8, 3, 3)])
def test_pca_dims_capped(n, d, pca_dim, dims):
    x_ND = np.random.default_rng(0).normal(size=(n, d))
    f = fit_clusterer(x_ND, 2, method="kmeans", pca_dim=pca_dim)
    assert f.dims == dims and f.pca.n_components_ == dims and f.input_dim == d
    assert not f.pca.whiten


def test_cluster_report_by_hand():
    labels_N = np.array([0, 0, 1, 1, 1, 2])
    domains_N = np.array([0, 0, 0, 1, 1, 1])
    r = cluster_report(labels_N, domains_N, ["a", "b"])
    assert r["table"] == [[2, 0], [1, 2], [0, 1]]
    assert r["pur"] == pytest.approx(5 / 6)  # (2 + 2 + 1) / 6, seed 001 Eq. 11
    assert r["nmi"] == pytest.approx(normalized_mutual_info_score(domains_N, labels_N))
    assert (r["sentences"], r["num_clusters"], r["cluster_sizes"]) == (6, 3, [2, 3, 1])
    r4 = cluster_report(labels_N, domains_N, ["a", "b"], num_clusters=4)
    assert r4["table"][3] == [0, 0] and r4["pur"] == r["pur"] and r4["nmi"] == r["nmi"]


# --------------------------------------------------------------------------------- errors
def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_unknown_method(data):
    with pytest.raises(ConfigError) as exc:
        fit_clusterer(data["x"], C, method="dbscan")
    msg = one_line(exc)
    assert msg.startswith("moa.clusterer:") and "'dbscan'" in msg and "birch, gmm, kmeans" in msg


def test_more_clusters_than_sentences(data):
    with pytest.raises(ConfigError) as exc:
        fit_clusterer(data["x"][:4], 5)
    msg = one_line(exc)
    assert msg.startswith("moa.num_clusters:") and "expected at most the N=4 sampled" in msg


@pytest.mark.parametrize("k", [1, 0, -3, 2.5, True])
def test_too_few_clusters(data, k):
    with pytest.raises(ConfigError, match=r"^moa\.num_clusters: expected an integer >= 2"):
        fit_clusterer(data["x"], k)


def test_bad_pca_dim(data):
    with pytest.raises(ConfigError, match=r"^moa\.pca_dim: expected a positive integer, got 0"):
        fit_clusterer(data["x"], C, pca_dim=0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_features(data, fitted, bad):
    x = data["x"].copy()
    x[7, 3] = bad
    with pytest.raises(DataError) as exc:
        fit_clusterer(x, C)
    assert "1 of 500 sentences have non-finite values" in one_line(exc) and "row 7" in str(
        exc.value)
    with pytest.raises(DataError, match="row 7"):
        fitted["kmeans"].predict(x)


def test_predict_wrong_feature_dim(fitted):
    with pytest.raises(DataError, match=r"expected dim 32 .* got 16"):
        fitted["gmm"].predict(np.zeros((3, 16)))


def test_gmm_fit_failure_is_a_data_error():
    # 40 points in 32 dims at scale 1e8: singleton components, reg_covar=1e-6 is negligible
    x_ND = np.random.default_rng(0).normal(size=(40, 32)) * 1e8
    with pytest.raises(DataError) as exc:
        fit_clusterer(x_ND, 10, method="gmm", standardize=False)
    msg = one_line(exc)
    assert "gmm failed on the 40 sampled sentences" in msg and "moa.num_clusters" in msg


def test_report_domain_out_of_range():
    with pytest.raises(DataError, match=r"domain ids span \[0, 2\] but 2 domain names"):
        cluster_report(np.array([0, 1]), np.array([0, 2]), ["a", "b"])


def _state(f: FittedClusterer, **change) -> dict:
    """The dict `save` writes, with `change` applied (for hand-made files)."""
    state = {fl.name: getattr(f, fl.name) for fl in fields(f)}
    state |= {"format_version": FORMAT_VERSION, "sklearn_version": sklearn.__version__}
    return state | change


def test_load_missing_and_corrupt(tmp_path, fitted):
    missing = tmp_path / "nope.skops"
    with pytest.raises(CheckpointError) as exc:
        load_clusterer(missing)
    assert one_line(exc).startswith(f"{missing}: clusterer file not found")

    good = tmp_path / "good.skops"
    fitted["kmeans"].save(good)
    blob = good.read_bytes()
    cases = {"garbage.skops": (b"not a skops file at all", "not a readable clusterer file"),
             "truncated.skops": (blob[: len(blob) // 2], "not a readable clusterer file"),
             "empty.skops": (b"", "not a readable clusterer file"),
             "foreign.skops": (sio.dumps([1, 2, 3]), f"not a clusterer file of format "
                                                     f"{FORMAT_VERSION} (found 'list')"),
             "future.skops": (sio.dumps({"format_version": 99}), "(found 99)"),
             "partial.skops": (sio.dumps({"format_version": FORMAT_VERSION, "method": "gmm"}),
                               "malformed clusterer file (missing pca, model,"),
             "listmethod.skops": (sio.dumps(_state(fitted["kmeans"], method=[1])),
                                  "malformed clusterer file (method [1])"),
             "arrayversion.skops": (sio.dumps({"format_version": np.arange(2)}),
                                    "not a clusterer file of format"),
             "wrongmodel.skops": (sio.dumps(_state(fitted["kmeans"], method="gmm")),
                                  "model is a KMeans, expected GaussianMixture"),
             "wrongpca.skops": (sio.dumps(_state(fitted["kmeans"], pca=[1.0])),
                                "pca is a list, expected PCA")}
    for name, (content, expected) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError) as exc:
            load_clusterer(tmp_path / name)
        msg = one_line(exc)
        assert msg.startswith(f"{tmp_path / name}: "), name
        assert expected in msg, (name, msg)


def test_untrusted_types_are_refused_before_loading(tmp_path, fitted):
    bad = tmp_path / "evil.skops"
    # a callable object where a string belongs: skops would build it if trusted
    sio.dump(_state(fitted["gmm"], method=functools.partial(print, "ran")), bad)
    with pytest.raises(CheckpointError) as exc:
        load_clusterer(bad)
    msg = one_line(exc)
    assert msg.startswith(f"{bad}: holds untrusted types ") and "functools.partial" in msg
    assert "refusing to load it" in msg and "builtins.print" in msg


def test_sklearn_version_is_checked(tmp_path, fitted, caplog):
    major, minor, *_ = sklearn.__version__.split(".")
    other_minor = tmp_path / "minor.skops"
    sio.dump(_state(fitted["gmm"], sklearn_version=f"{major}.{int(minor) + 1}.0"), other_minor)
    with pytest.raises(CheckpointError) as exc:
        load_clusterer(other_minor)
    msg = one_line(exc)
    assert f"scikit-learn {major}.{int(minor) + 1}.0" in msg and sklearn.__version__ in msg
    unversioned = tmp_path / "unversioned.skops"
    sio.dump(_state(fitted["gmm"], sklearn_version=None), unversioned)
    with pytest.raises(CheckpointError, match="no scikit-learn version stored"):
        load_clusterer(unversioned)
    # another patch release of the same minor: loaded, with a warning naming both versions
    patch = tmp_path / "patch.skops"
    sio.dump(_state(fitted["gmm"], sklearn_version=f"{major}.{minor}.999"), patch)
    with caplog.at_level("WARNING"):
        assert load_clusterer(patch).method == "gmm"
    assert f"{major}.{minor}.999" in caplog.text and sklearn.__version__ in caplog.text


def test_standardizing_finds_clusters_that_a_loud_dimension_hides() -> None:
    """Two true groups differ in 8 quiet dimensions; one loud dimension of pure noise has most of
    the variance. Raw PCA to 1 dim keeps the loud noise; standardised PCA keeps the groups."""
    rng = np.random.default_rng(0)
    y_N = np.repeat([0, 1], 200)
    x_ND = rng.normal(size=(400, 9)) * 0.3
    x_ND[:, :8] += np.where(y_N[:, None] == 0, -1.0, 1.0)
    x_ND[:, 8] = rng.normal(size=400) * 100.0
    for standardize, lowest, highest in ((True, 0.95, 1.0), (False, 0.0, 0.7)):
        f = fit_clusterer(x_ND, 2, method="kmeans", pca_dim=1, standardize=standardize)
        pur = cluster_report(f.predict(x_ND), y_N, ["a", "b"])["pur"]
        assert lowest <= pur <= highest, (standardize, pur)
    assert np.allclose(f.scale_D, 1.0)


def test_gmm_keeps_the_best_of_several_initialisations(data) -> None:
    one = fit_clusterer(data["x"], C + 3, method="gmm", pca_dim=4, inits=1)
    five = fit_clusterer(data["x"], C + 3, method="gmm", pca_dim=4, inits=5)
    assert (one.model.n_init, five.model.n_init) == (1, 5)
    assert five.model.lower_bound_ >= one.model.lower_bound_  # its first run is `one`'s


def test_unit_norm_clusters_directions_not_magnitudes() -> None:
    """Three groups differ in direction; half of every group is 15x louder (as sentences with
    more or fewer shared words spread differently). Plain GMM splits by loudness; on the unit
    sphere the groups come back."""
    rng = np.random.default_rng(0)
    C, D, n = 3, 8, 300
    y_N = np.repeat(np.arange(C), n)
    mu_CD = rng.normal(size=(C, D))
    mu_CD -= mu_CD.mean(axis=0)
    loud_N = np.where(rng.random(C * n) < 0.5, 0.2, 3.0)
    x_ND = loud_N[:, None] * (mu_CD[y_N] + 0.3 * rng.normal(size=(C * n, D)))
    purity = {}
    for unit_norm in (False, True):
        f = fit_clusterer(x_ND, C, method="gmm", pca_dim=D, whiten=False, unit_norm=unit_norm)
        purity[unit_norm] = cluster_report(f.predict(x_ND), y_N, list("abc"))["pur"]
    assert purity[False] < 0.75 and purity[True] > 0.95, purity


@pytest.mark.parametrize("whiten,unit_norm", [(True, False), (True, True), (False, False)])
def test_projection_whitens_and_normalises(tmp_path, data, whiten, unit_norm) -> None:
    f = fit_clusterer(data["x"], C, method="gmm", pca_dim=4, whiten=whiten, unit_norm=unit_norm)
    z_NP = f.project(data["x"])
    norms_N = np.linalg.norm(z_NP, axis=1)
    assert np.allclose(norms_N, 1.0) == unit_norm
    if whiten and not unit_norm:
        assert np.allclose(z_NP.var(axis=0, ddof=1), 1.0, atol=1e-6)
    f.save(tmp_path / "c.skops")
    again = load_clusterer(tmp_path / "c.skops")
    assert again.unit_norm == unit_norm and again.pca.whiten == whiten
    assert np.array_equal(again.predict(data["x"]), f.predict(data["x"]))


def test_a_direction_without_variance_is_not_whitened_into_the_features() -> None:
    """Mean-pooled affine LayerNorm outputs lie in D - 1 dims: PCA to D whitened the last
    direction's rounding noise to unit variance (PUR 0.99 -> 0.77); it is left out."""
    rng = np.random.default_rng(0)
    D, C, n, T = 16, 4, 2000, 20
    gamma, beta = rng.uniform(0.5, 1.5, D), rng.normal(0, 0.1, D)
    mu, y = rng.normal(0, 1, (C, D)), rng.integers(0, C, n)
    x = mu[y][:, None, :] + rng.normal(0, 3, (n, T, D))
    normed = (x - x.mean(-1, keepdims=True)) / x.std(-1, keepdims=True)
    X = (gamma * normed + beta).mean(1).astype(np.float32)
    full = fit_clusterer(X, C, "gmm", D, 0, True, 5, True, True)
    assert full.dims == D - 1
    assert cluster_report(full.predict(X), y, list("abcd"), C)["pur"] > 0.95
