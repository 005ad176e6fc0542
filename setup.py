"""The repository keeps the packages of rtrain side by side at its top: the supervisor
(`supervisor/`), the worker (`worker/`) and the checkpoint format both of them use
(`checkpoint/`); installed, they are `rtrain.supervisor`, `rtrain.worker` and
`rtrain.checkpoint`, under the one import package `rtrain` (`rtrain/`), and nothing else lands in
site-packages. Everything else about the build is in pyproject.toml; only this mapping needs
code, so that a new folder ships without a list to keep."""

from setuptools import find_packages, setup

SUBPACKAGES = ("supervisor", "worker", "checkpoint")

setup(
    package_dir={"rtrain": "rtrain", **{f"rtrain.{sub}": sub for sub in SUBPACKAGES}},
    packages=["rtrain", *(f"rtrain.{name}"
                          for name in find_packages(include=[f"{sub}*" for sub in SUBPACKAGES]))],
)
