"""Adapter experts (`AdapterConfig`, the ``adapters`` section) and the stage-wise MoA recipe
(`MoAConfig`, the ``moa`` section).

Adapters sit in the Transformer's adapter slot after each layer's FFN (MoA Eq. 3-4): one per
layer for the pre-injected backbone, K routed per sentence for MoA (Gumbel-Max over a distilled
gate), one per known domain for the ADPT baseline (task routing by domain), or learned sentence
gates for the Switch-SL / SGMoE-SL baselines. Errors name the field as ``adapters.<field>`` or
``moa.<field>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

from moe_train.config.moe import RouterConfig, _at_most, _expect

ADAPTER_SIDES = ("decoder", "both")
CLUSTERERS = ("gmm", "kmeans", "birch")


@dataclass
class AdapterConfig(RouterConfig):
    """The ``adapters`` section: router settings plus where the adapters go and their size."""

    section: ClassVar[str] = "adapters"

    k: int = 4
    """Gumbel-Max candidates for the `gumbel` router (MoA default 4); experts per sentence for
    the `sentence` router (1: Switch-SL, 2: SGMoE-SL); 1 for `single` and oracle `task`."""
    aux_loss_coef: float = 0.0
    """Load-balance loss weight (learned sentence gates only; the SL baselines use 0.01)."""
    z_loss_coef: float = 0.0
    """Router z-loss weight (learned sentence gates only)."""
    num_experts: int = 0
    """Adapters per layer; 0: no adapters, 1: one (pre-injected) adapter per layer."""
    dim: int = 128
    """Inner (bottleneck) dimension of each adapter."""
    sides: str = "decoder"
    """Where adapters go: decoder (MoA: after every decoder layer) or both (ADPT)."""
    router: str = "single"
    """Adapter router (moe_train.moe.registry.ROUTERS): single, gumbel, sentence, task, ..."""
    dropout: float = 0.0
    """Dropout on the adapters' combined output before the residual add (Gated Adapters'
    reference code uses the model's dropout, 0.3); 0: none, as MoA and the recorded runs."""
    activation_dropout: float = 0.0
    """Dropout after each adapter's ReLU (the reference code's activation dropout)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("dropout", "activation_dropout"):
            _expect(0.0 <= getattr(self, name) < 1.0, f"adapters.{name}",
                    "a probability in [0, 1)", getattr(self, name))
        _expect(self.num_experts >= 0, "adapters.num_experts", "a non-negative integer",
                self.num_experts)
        _expect(self.dim >= 1, "adapters.dim", "a positive integer", self.dim)
        _at_most("experts", self, "adapters", "num_experts")
        _at_most("size", self, "adapters", "dim")
        _expect(self.sides in ADAPTER_SIDES, "adapters.sides",
                f"one of {', '.join(ADAPTER_SIDES)}", self.sides)
        if self.router == "single":
            _expect(self.num_experts <= 1, "adapters.num_experts",
                    "0 or 1 for the single router (use gumbel, sentence or task for more)",
                    self.num_experts)

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def on_side(self, side: str) -> bool:
        """Whether the layers of `side` get an adapter."""
        return self.enabled and (self.sides == "both" or side == "decoder")

    def router_config(self) -> RouterConfig:
        """The plain router settings (errors from the router then name ``moe.*`` fields)."""
        return RouterConfig(**{f.name: getattr(self, f.name) for f in fields(RouterConfig)})


@dataclass
class MoAConfig:
    """The ``moa`` section: the stage-wise recipe (backbone, features, cluster, distill,
    adapters, evaluate); see moe_train.stages."""

    workdir: str = "work/moa"
    """Stage artifacts go to <workdir>/<stage>/; a finished stage is reused."""
    backbone_dir: str = ""
    """Reuse a finished backbone stage from another recipe's workdir ('' : train it here)."""
    pre_inject: bool = True
    """Train the backbone with one adapter per decoder layer, later copied into the K adapters
    (MoA's "Pre-A"); False is the "naive MoA" ablation (adapters start fresh)."""
    num_clusters: int = 12
    """K: clusters = adapters per layer."""
    sample_size: int = 200000
    """Source sentences sampled from the training set for clustering (all if fewer)."""
    anchors_per_domain: int = 0
    """Domain anchors (seed 001 "DI"): this many labelled dev sentences per domain joined to
    the sample; 0 clusters the random sample alone ("RS")."""
    anchor_domains: list[str] = field(default_factory=list)
    """Domains that provide anchors (default: every domain of the data)."""
    pca_dim: int = 64
    """PCA dimension before clustering (paper: 512 -> 64)."""
    clusterer: str = "gmm"
    """gmm (full covariance, the paper's choice), kmeans or birch."""
    cluster_inits: int = 5
    """Initialisations of the clusterer; the best by likelihood is kept (gmm; kmeans runs at
    least 10). sklearn's GMM default, 1, often stops in a poor local optimum."""
    standardize: bool = True
    """Divide each feature by its standard deviation over the sample before PCA (False: PCA of
    the raw features, as the papers describe it)."""
    whiten: bool | None = None
    """Whiten the PCA output (unit variance per component; the papers: False). Steers GMM's
    k-means initialisation away from high-variance non-domain directions. None: True for gmm,
    False for kmeans and birch (whose distances it distorts)."""
    unit_norm: bool | None = None
    """Scale each PCA vector to unit length before clustering, so clusters follow directions,
    not magnitudes (the papers: False). None: as `whiten`."""
    distill_steps: int = 2000
    """Gate distillation updates (paper: 10k)."""
    distill_batch_sentences: int = 256
    """Sentences per distillation batch (over all ranks)."""
    distill_lr: float = 1e-3
    """Adam learning rate of the gate distillation."""
    adapter_steps: int = 2000
    """Adapter-stage updates."""
    adapter_lr: float = 5e-4
    """Peak learning rate of the adapter stage."""
    adapter_warmup_steps: int | None = None
    """Warm-up steps of the adapter stage's schedule (None: ``optim.warmup_steps``, the
    backbone's). Lets a backbone schedule sized for training from scratch leave the short
    adapter stage's schedule as it is."""
    unfreeze_decoder: bool = False
    """Train the decoder with the adapters (MoA's "Unf-D"); the encoder stays frozen."""
    eval_sentences: int = 500
    """Test sentences per domain for the evaluation stage (seed 001's RND set draws from them)."""
    eval_beam: int = 4
    """Beam size of the evaluation stage."""
    seed: int = 0
    """Sampling and clustering seed."""

    def __post_init__(self) -> None:
        _expect(bool(self.workdir), "moa.workdir", "a directory", self.workdir)
        _expect(self.num_clusters >= 2, "moa.num_clusters", "at least 2", self.num_clusters)
        _at_most("experts", self, "moa", "num_clusters")
        for name in ("sample_size", "pca_dim", "cluster_inits", "distill_steps",
                     "distill_batch_sentences",
                     "adapter_steps", "eval_sentences", "eval_beam"):
            _expect(getattr(self, name) >= 1, f"moa.{name}", "a positive integer",
                    getattr(self, name))
        _expect(0 <= self.seed < 2**32, "moa.seed", "an integer in 0..4294967295 (numpy's "
                "and scikit-learn's seed range)", self.seed)
        _expect(self.anchors_per_domain >= 0, "moa.anchors_per_domain",
                "a non-negative integer", self.anchors_per_domain)
        _expect(isinstance(self.anchor_domains, list), "moa.anchor_domains",
                "a list of domain names", self.anchor_domains)
        _expect(len(set(map(str, self.anchor_domains))) == len(self.anchor_domains),
                "moa.anchor_domains", "each domain once", self.anchor_domains)
        _expect(self.clusterer in CLUSTERERS, "moa.clusterer", f"one of {', '.join(CLUSTERERS)}",
                self.clusterer)
        for name in ("whiten", "unit_norm"):
            if getattr(self, name) is None:
                setattr(self, name, self.clusterer == "gmm")
        _expect(self.adapter_warmup_steps is None or self.adapter_warmup_steps >= 0,
                "moa.adapter_warmup_steps", "a non-negative integer or null",
                self.adapter_warmup_steps)
        _expect(self.distill_lr > 0 and self.adapter_lr > 0, "moa.distill_lr",
                "positive learning rates (distill_lr, adapter_lr)",
                (self.distill_lr, self.adapter_lr))
