"""moe_train: Mixture-of-Experts training for neural machine translation on DeepSpeed."""

__version__ = "0.1.0"
