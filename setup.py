"""cursor_rl: train coding agents the Composer 2 way, in JAX.

Versions are bounded here and pinned exactly in `constraints.txt`, which the
launch scripts pass to pip so a fresh install resolves quickly and the same way
every time.
"""

import setuptools

_CORE = [
    "jax>=0.10.2,<0.11",
    "flax>=0.12.8,<0.13",
    "optax>=0.2.8,<0.3",
    "orbax-checkpoint>=0.12.8,<0.13",
    "grain>=0.2.18,<0.3",
    "ml-collections>=1.1.0,<1.2",
    "etils[epath]>=1.15,<2",  # cursor_rl.workdir: local and gs:// paths (brings fsspec)
    "tensorstore>=0.1.86,<0.2",
    "tokenizers>=0.23,<0.24",
    "safetensors>=0.8,<0.9",
    "numpy>=2.0,<3",
    "absl-py>=2.1,<3",
    "tensorboardX>=2.6,<2.7",
    "matplotlib>=3.8,<4",  # the run report's plots
]

_EXTRAS = {
    # TPU: libtpu lets JAX run on TPU VMs and compile ahead-of-time for TPU topologies.
    "tpu": ["jax[tpu]>=0.10.2,<0.11"],
    # NVIDIA GPUs (CUDA 12 wheels from PyPI).
    "gpu": ["jax[cuda12]>=0.10.2,<0.11"],
    # Hugging Face parity tests and conversion, Kimi K2's tiktoken tokenizer. torch is
    # pinned: an unpinned torch resolves to a multi-GB CUDA build; 2.13.0 is the CPU wheel.
    "hf": ["torch==2.13.0", "transformers>=5.0,<6", "tiktoken>=0.14,<0.15"],
    "seqio": ["seqio==0.0.20"],
    "xm": ["xmanager==0.8.5.post1"],
    # gs:// workdirs: epath writes the run's own files through gcsfs; gcsfs brings
    # google-cloud-storage, which Orbax asks about the bucket (tensorstore writes the
    # arrays itself). Add it to a pod's extras: `.[tpu,gcs]`.
    "gcs": ["gcsfs>=2024.6"],
    # Tool calls and grading on a Ray cluster (rl.tool_backend="ray"); plain ray, no
    # dashboard: a ~80 MB wheel. The test extra has it so CI runs the Ray pool's tests.
    "ray": ["ray>=2.60,<2.61"],
    "test": ["pytest>=8,<10", "ruff>=0.17,<0.18", "ray>=2.60,<2.61"],
}

setuptools.setup(
    name="cursor_rl",
    version="0.1.0",
    description="Continued pretraining and agentic RL for coding models, JAX-native.",
    packages=setuptools.find_packages(include=["cursor_rl", "cursor_rl.*"]),
    # Data files that ship with the code (the built-in SFT demonstrations).
    package_data={
        "cursor_rl.data": ["*.jsonl"],
        "cursor_rl.outer": ["*.jsonl"],  # the example product-feedback file
        # The shipped base models (cursor_rl/bases/NAME/: safetensors, config, tokenizer).
        "cursor_rl.bases": ["*/*.json", "*/*.safetensors", "*/SHA256SUMS", "*/README.md"],
    },
    python_requires=">=3.11",
    install_requires=_CORE,
    extras_require=_EXTRAS,
)
