"""Typed experiment configuration.

One small dataclass per component, each validated on construction. Errors name the field by its
dotted path (``optim.lr``) and say what is allowed. YAML (see `loader.py`) only loads into these.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moe_train.config.deepspeed_entries import check_deepspeed_entries
from moe_train.config.adapters import AdapterConfig, MoAConfig
from moe_train.config.moe import ROUTER_NAMES, MoEConfig, _at_most
from moe_train.config.gated import GatedConfig
from moe_train.config.qwen import QwenConfig
from moe_train.data.prompts import DEFAULT_PROMPT, check_template
from moe_train.config.thor import ThorConfig
from moe_train.errors import ConfigError
from moe_train.eval.limits import MAX_BEAM, MAX_LENPEN


ARCHS = ("seq2seq", "hf_qwen2_moe")
"""Model architectures `model.arch` names (dispatched in moe_train.models.build)."""


def _check(cond: bool, path: str, expected: str, got: Any) -> None:
    if not cond:
        raise ConfigError(f"{path}: expected {expected}, got {got!r}")


def _positive(obj: Any, section: str, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _check(value > 0, f"{section}.{name}", "a positive number", value)


def _choice(obj: Any, section: str, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    _check(value in allowed, f"{section}.{name}", f"one of {', '.join(allowed)}", value)


@dataclass
class ModelConfig:
    """Encoder-decoder Transformer (pre-norm, tied embeddings), or the decoder-only arch."""

    arch: str = "seq2seq"
    """seq2seq (this section's encoder-decoder Transformer) or hf_qwen2_moe (a Hugging Face
    Qwen2-MoE decoder-only model shaped by the ``qwen`` section, our MoE layer in its blocks);
    the other fields of this section describe the seq2seq model only."""
    d_model: int = 512
    """Model (embedding) dimension."""
    n_heads: int = 8
    """Attention heads; must divide d_model."""
    ffn_dim: int = 2048
    """Inner dimension of each feed-forward block."""
    encoder_layers: int = 6
    """Number of encoder layers."""
    decoder_layers: int = 6
    """Number of decoder layers."""
    dropout: float = 0.1
    """Dropout on embeddings and residual branches."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    activation_dropout: float = 0.0
    """Dropout after the FFN activation."""
    activation: str = "relu"
    """FFN activation: relu or gelu."""
    max_positions: int = 1024
    """Longest sequence (tokens) the sinusoidal positions cover."""
    tie_embeddings: bool = True
    """Share source embedding, target embedding and output projection (joint vocabulary)."""
    activation_checkpointing: bool = False
    """Recompute every layer's activations in backward instead of keeping them (both archs):
    memory for about a third more compute (`moe-train plan --activation-checkpointing`)."""

    def __post_init__(self) -> None:
        _positive(self, "model", "d_model", "n_heads", "ffn_dim", "encoder_layers",
                  "decoder_layers", "max_positions")
        _at_most("size", self, "model", "d_model", "n_heads", "ffn_dim", "max_positions")
        _at_most("layers", self, "model", "encoder_layers", "decoder_layers")
        _check(self.d_model % self.n_heads == 0, "model.d_model",
               f"a multiple of model.n_heads ({self.n_heads})", self.d_model)
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            value = getattr(self, name)
            _check(0.0 <= value < 1.0, f"model.{name}", "a probability in [0, 1)", value)
        _choice(self, "model", "activation", ("relu", "gelu"))
        _choice(self, "model", "arch", ARCHS)


@dataclass
class DataConfig:
    """Corpora, sentencepiece and batching."""

    prepared_dir: str = "work/prepared"
    """Directory written by `moe-train prepare` (manifest.json, spm.model, shards)."""
    pairs: list[str] = field(default_factory=list)
    """Directed language pairs to use, as src-tgt (e.g. de-en); empty: every pair found, in the
    direction its file name gives."""
    domains: list[str] = field(default_factory=list)
    """Domains (corpus folders) to use; empty: all."""
    vocab_size: int = 8000
    """Joint sentencepiece vocabulary size."""
    spm_model_type: str = "unigram"
    """sentencepiece model type: unigram or bpe."""
    spm_max_sentences: int = 2_000_000
    """At most this many sentences (both sides) are sampled to train sentencepiece."""
    max_tokens: int = 4096
    """Token budget of one micro-batch on one rank (source or target, whichever is longer, padded)."""
    max_len: int = 256
    """Training pairs with a side longer than this many subword tokens are skipped."""
    eval_max_len: int = 1000
    """Dev/test pairs with a side longer than this many subword tokens are skipped: long, so
    that scores cover (nearly) the whole held-out set, but at most the positions of the model
    that validates on them (training checks)."""
    max_chars: int = 2048
    """Lines longer than this many characters are rejected during validation."""
    temperature: float = 1.0
    """Sampling temperature over corpora: corpus i is drawn with p_i^(1/T) (1 = proportional)."""
    lang_tags: bool = False
    """Prefix every source with a <2xx> target-language tag (multilingual runs)."""
    domain_tags: bool = False
    """Prefix every source with a <dom:NAME> domain tag (the TAG baseline of Gated Adapters, seed
    004); the tag comes before the <2xx> language tag."""
    dev_per_domain: int = 200
    """Sentence pairs carved out per corpus for the dev split when the data has no dev files."""
    test_per_domain: int = 200
    """Sentence pairs carved out per corpus for the test split when the data has no test files."""
    tokenizer: str = ""
    """A Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json, e.g. the
    model directory of a decoder-only model) used instead of training sentencepiece; ''
    trains sentencepiece."""
    prompt_template: str = ""
    """Decoder-only models: each source becomes this instruction prompt (placeholders
    {source}, {src_lang}, {tgt_lang}, {src_name}, {tgt_name}; see moe_train.data.prompts);
    '' keeps sources as they are (encoder-decoder models), or, for model.arch hf_qwen2_moe,
    means the default template."""
    num_workers: int = 0
    """Reserved for background batch prefetching (0: batches are built in the training process)."""

    def __post_init__(self) -> None:
        for i, pair in enumerate(self.pairs):
            parts = pair.split("-")
            _check(len(parts) == 2 and all(parts), f"data.pairs[{i}]", "src-tgt such as de-en",
                   pair)
        _positive(self, "data", "vocab_size", "spm_max_sentences", "max_tokens", "max_len",
                  "eval_max_len", "max_chars", "temperature")
        _at_most("size", self, "data", "vocab_size", "max_tokens", "max_len", "eval_max_len",
                 "max_chars")
        _choice(self, "data", "spm_model_type", ("unigram", "bpe"))
        _check(self.max_tokens > self.max_len, "data.max_tokens",
               f"at least data.max_len + 1 ({self.max_len + 1}: a longest sentence with its "
               "end-of-sentence token)", self.max_tokens)
        if self.prompt_template:
            check_template(self.prompt_template)
        if self.tokenizer:
            _check(not (self.lang_tags or self.domain_tags), "data.lang_tags",
                   "false with data.tokenizer (<2xx> and <dom:NAME> tags are sentencepiece "
                   "symbols; a prompt names the languages)", self.lang_tags or self.domain_tags)
        for name in ("dev_per_domain", "test_per_domain", "num_workers"):
            _check(getattr(self, name) >= 0, f"data.{name}", "a non-negative integer",
                   getattr(self, name))


@dataclass
class OptimConfig:
    """AdamW with inverse-square-root (Noam) warm-up and label-smoothed cross-entropy."""

    lr: float = 7e-4
    """Peak learning rate, reached at the end of warm-up."""
    betas: tuple[float, float] = (0.9, 0.98)
    """Adam betas."""
    eps: float = 1e-9
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    warmup_steps: int = 4000
    """Linear warm-up steps; afterwards lr decays as lr * sqrt(warmup / step)."""
    label_smoothing: float = 0.1
    """Label smoothing of the cross-entropy."""
    clip_norm: float = 1.0
    """Gradient-norm clipping (0 disables)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage: 0, 1, 2 or 3 (3: parameters partitioned too, MoE layers as leaf
    modules; expert parallelism needs 0-2)."""
    precision: str = "auto"
    """fp32, bf16, fp16, or auto (fp32 on CPU, bf16 on GPUs that support it, else fp16)."""
    max_nonfinite_steps: int = 10
    """Consecutive steps with a non-finite loss or gradient norm (each skipped: no update on
    any rank) after which the run stops, naming the last good checkpoint."""

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # YAML gives a list
        _positive(self, "optim", "lr", "eps", "grad_accum", "max_nonfinite_steps")
        _check(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), "optim.betas",
               "two numbers in [0, 1)", self.betas)
        _check(self.warmup_steps >= 0, "optim.warmup_steps", "a non-negative integer",
               self.warmup_steps)
        _check(0.0 <= self.label_smoothing < 1.0, "optim.label_smoothing",
               "a probability in [0, 1)", self.label_smoothing)
        _check(self.clip_norm >= 0, "optim.clip_norm", "a non-negative number", self.clip_norm)
        _check(self.weight_decay >= 0, "optim.weight_decay", "a non-negative number",
               self.weight_decay)
        _check(self.zero_stage in (0, 1, 2, 3), "optim.zero_stage", "one of 0, 1, 2, 3",
               self.zero_stage)
        _choice(self, "optim", "precision", ("auto", "fp32", "bf16", "fp16"))


@dataclass
class TrainConfig:
    """The training loop."""

    max_steps: int = 100_000
    """Optimizer steps to train for."""
    max_minutes: float = 0.0
    """Stop training (with a checkpoint) once this much wall-clock time has passed; 0 means no
    limit. The final validation (with BLEU), save and export follow it: leave them a margin
    under a scheduler's limit (the run's last line says how long they took). In a pipeline
    the limit is the stage's budget: a stage it stops is finished, as at max_steps."""
    seed: int = 1
    """Seed for parameters, dropout and data order."""
    log_every: int = 50
    """Steps between TensorBoard / console scalars."""
    validate_every: int = 1000
    """Steps between dev-set loss evaluations (0: only at the end)."""
    bleu_every: int = 0
    """Steps between dev BLEU evaluations with greedy decoding, a multiple of validate_every
    (0: only at the end)."""
    bleu_sentences: int = 200
    """Dev sentences decoded for the periodic BLEU."""
    progress_bar: bool = True
    """Show a progress bar on rank 0 (off automatically when stderr is not a terminal)."""
    patience: int = 0
    """Early stopping: stop once this many validations in a row brought no improvement of
    `early_stop_metric` by more than `min_delta` (0: never; needs validate_every)."""
    early_stop_metric: str = "loss"
    """loss (dev loss) or bleu (dev greedy BLEU, then computed at every validation)."""
    min_delta: float = 0.0
    """Smallest change of the early-stopping metric that counts as an improvement: for
    `patience`, and for the best validation `export_best` exports (as Keras' EarlyStopping
    restores its best weights)."""
    init_from: str = ""
    """Start a fresh run from these weights: a moe_train export or checkpoint directory, or a
    local Hugging Face Qwen2-MoE directory (model.arch hf_qwen2_moe), every name and shape
    exactly the model's. Read one tensor at a time; under ZeRO-3 (hf_qwen2_moe) the model is
    built partitioned and no rank holds it whole. Ignored on resume (the checkpoint wins)."""
    export_best: bool = True
    """With early stopping (patience > 0): export the weights of the best validation, not the
    last step's (fairseq's checkpoint_best). Each new best is checkpointed and kept through
    `checkpoint.keep_last` rotation; the last step's checkpoint stays the one to resume."""

    def __post_init__(self) -> None:
        _positive(self, "train", "max_steps", "log_every")
        _check(0 <= self.seed < 2**32, "train.seed", "an integer in 0..4294967295 (numpy's and "
               "sentencepiece's seed range)", self.seed)
        for name in ("validate_every", "bleu_every", "bleu_sentences", "max_minutes",
                     "patience", "min_delta"):
            _check(getattr(self, name) >= 0, f"train.{name}", "a non-negative number",
                   getattr(self, name))
        _check(self.early_stop_metric in ("loss", "bleu"), "train.early_stop_metric",
               "loss or bleu", self.early_stop_metric)
        _check(not self.patience or self.validate_every > 0, "train.patience",
               "0 unless train.validate_every > 0 (early stopping needs validations)",
               self.patience)
        _check(not self.bleu_every or (self.validate_every > 0
                                       and self.bleu_every % self.validate_every == 0),
               "train.bleu_every", "0 or a multiple of train.validate_every (BLEU is computed "
               "with a validation)", self.bleu_every)


@dataclass
class CheckpointConfig:
    """Checkpointing."""

    dir: str = "work/checkpoints"
    """Directory holding step checkpoints and the 'latest' pointer."""
    save_every: int = 1000
    """Steps between checkpoints (a final one is always written)."""
    keep_last: int = 3
    """How many step checkpoints to keep (0 keeps all)."""

    def __post_init__(self) -> None:
        _positive(self, "checkpoint", "save_every")
        _check(self.keep_last >= 0, "checkpoint.keep_last", "a non-negative integer",
               self.keep_last)
        _check(bool(self.dir.strip()), "checkpoint.dir",
               "a directory (step checkpoints, latest and export go there)", self.dir)


@dataclass
class LoggingConfig:
    """Monitoring."""

    tensorboard_dir: str = "work/tensorboard"
    """Directory for TensorBoard event files ('' disables TensorBoard)."""


@dataclass
class EvalConfig:
    """Decoding."""

    beam: int = 5
    """Beam size (1 means greedy)."""
    lenpen: float = 1.0
    """Length penalty alpha: hypotheses are ranked by score / length**alpha."""
    max_len_a: float = 1.2
    """Maximum output length is max_len_a * source_length + max_len_b."""
    max_len_b: int = 10
    """See max_len_a."""
    max_sentences: int = 64
    """Sentences decoded per batch."""

    def __post_init__(self) -> None:
        _positive(self, "eval", "beam", "max_sentences")
        _at_most("size", self, "eval", "max_sentences", "max_len_b")
        _check(self.beam <= MAX_BEAM, "eval.beam", f"at most {MAX_BEAM}", self.beam)
        _check(0 <= self.lenpen <= MAX_LENPEN, "eval.lenpen",
               f"a number from 0 to {MAX_LENPEN} (length ** lenpen overflows beyond)",
               self.lenpen)
        _check(self.max_len_a >= 0 and self.max_len_b >= 0, "eval.max_len_a",
               "non-negative max_len_a and max_len_b", (self.max_len_a, self.max_len_b))




@dataclass
class ExperimentConfig:
    """A whole training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    adapters: AdapterConfig = field(default_factory=AdapterConfig)
    moa: MoAConfig = field(default_factory=MoAConfig)
    thor: ThorConfig = field(default_factory=ThorConfig)
    gated: GatedConfig = field(default_factory=GatedConfig)
    qwen: QwenConfig = field(default_factory=QwenConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    deepspeed: dict[str, Any] = field(default_factory=dict)
    """Raw DeepSpeed config entries merged over the generated DeepSpeed config."""

    def __post_init__(self) -> None:
        _check(isinstance(self.deepspeed, dict), "deepspeed", "a mapping", self.deepspeed)
        check_deepspeed_entries(self.deepspeed, "deepspeed.")
        _check(self.adapters.router in ROUTER_NAMES, "adapters.router",
               f"one of {', '.join(ROUTER_NAMES)}", self.adapters.router)
        thor, moe = self.thor, self.moe
        for side in ("encoder", "decoder") if self.uses_thor else ():
            if moe.router_name(side) != "thor":
                continue
            experts = moe.side_experts(side)  # each side's own count, where it has one
            if thor.candidate_sets:
                _check(thor.num_candidates <= experts, "thor.num_candidates",
                       f"at most the {side}'s experts ({experts})", thor.num_candidates)
            space = thor.num_candidates if thor.candidate_sets else experts
            if thor.token_routing == "topk":
                _check(moe.k <= space, "moe.k", f"at most {space} (the experts THOR's token "
                       f"router chooses from on the {side} side)", moe.k)
        if self.adapters.enabled:
            _check(self.adapters.num_experts % self.moe.ep_size == 0, "adapters.num_experts",
                   f"a multiple of moe.ep_size ({self.moe.ep_size})", self.adapters.num_experts)
        if self.adapters.enabled and self.adapters.router == "gated":
            _check(self.moe.ep_size == 1, "moe.ep_size", "1 with adapters.router gated (every "
                   "token uses every adapter: the adapters stay on each rank)", self.moe.ep_size)
        if self.decoder_only:
            self._check_decoder_only()
        if self.optim.zero_stage == 3:
            _check(self.moe.ep_size == 1, "moe.ep_size", "1 with optim.zero_stage 3 (expert "
                   "parallelism runs with ZeRO 0-2)", self.moe.ep_size)
        if self.moe.enabled:
            sides = (self.moe.encoder_router, self.moe.decoder_router)
            _check("gated" not in sides, "moe.encoder_router",
                   "an FFN router other than gated (gated mixes adapters: adapters.router)",
                   sides)

    @property
    def decoder_only(self) -> bool:
        """Whether the model is the decoder-only Qwen2-MoE (`model.arch` hf_qwen2_moe)."""
        return self.model.arch == "hf_qwen2_moe"

    def _check_decoder_only(self) -> None:
        """hf_qwen2_moe: the MoE shape comes from the moe section; no encoder, no adapters."""
        moe = self.moe
        _check(moe.enabled, "moe.num_experts", "a positive number of routed experts per MoE "
               "layer with model.arch hf_qwen2_moe", moe.num_experts)
        _check(moe.expert_ffn_dim > 0, "moe.expert_ffn_dim", "the routed experts' SwiGLU inner "
               "dimension (Qwen's moe_intermediate_size) with model.arch hf_qwen2_moe",
               moe.expert_ffn_dim)
        _check(moe.decoder_router not in ("dense", "gated"), "moe.decoder_router",
               "an FFN router (topk reproduces Qwen's) with model.arch hf_qwen2_moe",
               moe.decoder_router)
        _check(not self.adapters.enabled, "adapters.num_experts",
               "0 with model.arch hf_qwen2_moe (adapters are an encoder-decoder feature)",
               self.adapters.num_experts)
        data = self.data  # one row: a prompt and a target of up to data.max_len tokens each
        _check(data.max_tokens >= 2 * data.max_len, "data.max_tokens",
               f"at least 2 x data.max_len ({2 * data.max_len}) with model.arch hf_qwen2_moe (a "
               "row holds a prompt and a target of up to data.max_len tokens each)",
               data.max_tokens)
        if not self.data.prompt_template:
            self.data.prompt_template = DEFAULT_PROMPT

    @property
    def uses_thor(self) -> bool:
        """Whether a side routes with THOR-MoE (and the model has a task predictor)."""
        return self.moe.enabled and "thor" in (self.moe.encoder_router, self.moe.decoder_router)

    @property
    def uses_experts(self) -> bool:
        """Whether the model has MoE layers (FFN experts or adapter experts)."""
        return self.moe.enabled or self.adapters.enabled

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (JSON/YAML serialisable)."""
        out = dataclasses.asdict(self)
        out["optim"]["betas"] = list(self.optim.betas)
        return out
