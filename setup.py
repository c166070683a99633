"""Only what pyproject.toml cannot say: two folders of the repository ship inside the package,
so that a pip-installed streamkv has them: web/ (the demo page) as streamkv/web and
kernels_cu/ (the CUDA sources NVRTC compiles at run time) as streamkv/kernels_cu."""

from setuptools import find_namespace_packages, setup

setup(
    # Namespace packages too: data folders such as models/presets are then packages
    # whose files package-data can list (setuptools warns about them otherwise).
    packages=[
        *find_namespace_packages(include=["streamkv", "streamkv.*"], exclude=["*.__pycache__"]),
        "streamkv.web",
        "streamkv.kernels_cu",
    ],
    package_dir={"streamkv.web": "web", "streamkv.kernels_cu": "kernels_cu"},
)
