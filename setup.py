from setuptools import find_packages, setup

setup(
    name="ringcomm",
    version="0.1.0",
    description="Ring collectives (reduce-scatter, all-gather, all-reduce) over MPI with own CUDA kernels",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # csrc/ (the CUDA sources, compiled at run time by NVRTC) ships inside the package as ringcomm.csrc
    packages=find_packages(include=["ringcomm", "ringcomm.*"]) + ["ringcomm.csrc"],
    package_dir={"ringcomm.csrc": "csrc"},
    package_data={"ringcomm.csrc": ["*.cuh", "*.cu"]},
    install_requires=["numpy>=1.24", "mpi4py>=4.0", "ml_dtypes>=0.3"],
    extras_require={
        "test": ["pytest>=7", "mpi-pytest>=2025.0", "hypothesis>=6", "mpich", "matplotlib>=3.6", "ruff~=0.17.6"],
        # [ctk]: NVRTC and the CUDA headers from PyPI (a machine with only a driver has neither);
        # cuda-bindings: the driver calls CuPy does not wrap (cuMemGetAddressRange, pointer attributes)
        "cuda": ["cupy-cuda13x[ctk]>=14", "cuda-bindings>=13,<14"],
        "cuda12": ["cupy-cuda12x[ctk]>=14", "cuda-bindings>=12,<13"],
        "plot": ["matplotlib>=3.6"],
        # the torch.distributed backend (ringcomm.torch); the tests' CPU build: pip install "torch==2.13.0+cpu"
        "torch": ["torch>=2.4"],
    },
    entry_points={"console_scripts": ["ringcomm-bench=ringcomm.bench.__main__:main"]},
)
