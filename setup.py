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
    # triton: the GPU codec kernels' tests run it interpreted on CPU (a CUDA build of torch brings it anyway)
    extras_require={"test": ["pytest", "hypothesis", "triton"]},
)
