"""moe_train: Mixture-of-Experts training for neural machine translation on DeepSpeed."""

from setuptools import find_packages, setup

setup(
    name="moe_train",
    version="0.1.0",
    description="Mixture-of-Experts NMT training on DeepSpeed: expert-parallel routing, "
                "stage-wise multi-domain recipes, evaluation",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["moe_train", "moe_train.*"]),
    package_data={"moe_train": ["recipes/*.yaml"]},
    install_requires=[
        "torch>=2.6",  # transformers 5; CUDA nonzero_static; _foreach_norm(dtype=)
        "deepspeed>=0.19.5,<0.20",  # older releases rank top-k by logits
        "sentencepiece>=0.2,<0.3",
        "sacrebleu>=2.4,<3",
        "numpy>=1.24",
        "pyyaml>=6",
        "tqdm>=4.60",
        "tensorboard>=2.15,<3",
        "scikit-learn>=1.3",
        "matplotlib>=3.7",
        "openmpi>=5.0",
        "mpi4py>=4.0,<5",
        "safetensors>=0.4",  # exports: model.safetensors (no pickle)
        "skops>=0.10",  # scikit-learn models (clusterers, classifiers) without pickle
        # Hugging Face Qwen2-MoE (model.arch hf_qwen2_moe), its tokenizers, MarianMT baseline
        "transformers>=5.0,<6",
    ],
    extras_require={
        # triton: the GPU kernels' fast path; on CPU its interpreter runs the equivalence tests
        "gpu": ["triton>=3.0; platform_system == 'Linux'"],
        # megatron-core: the Megatron-style baseline of benchmarks/moe_layer.py
        "dev": ["pytest>=8", "pytest-xdist>=3", "triton>=3.0; platform_system == 'Linux'", "megatron-core>=0.9"],
    },
    entry_points={"console_scripts": ["moe-train=moe_train.cli:main"]},
)
