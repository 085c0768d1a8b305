from setuptools import find_packages, setup

setup(
    name="hvd_compress",
    version="0.1.0",
    description="Gradient compression for Horovod + PyTorch: PowerSGD, ACP-SGD, QSGD, Top-K, FP16/BF16",
    packages=find_packages(include=["hvd_compress", "hvd_compress.*"]),
    python_requires=">=3.10",  # compressors/config.py: @dataclass(kw_only=True)
    # Horovod is built from source against the installed torch (ci/setup.sh), so it is not
    # listed here: pip would otherwise try to build the unpatched release.
    install_requires=["torch>=2.1", "numpy"],
    # The benchmarks (benchmarks/, run from a checkout) also need matplotlib.
    extras_require={"test": ["pytest", "mpi4py", "scikit-learn", "tensorboard"], "tensorboard": ["tensorboard"]},
    # advise's quality evidence, from docs/benchmarks/ (python -m benchmarks evidence).
    package_data={"hvd_compress": ["data/*.json"]},
)
