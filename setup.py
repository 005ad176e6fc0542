"""The repository keeps the supervisor and the worker side by side at its top (`supervisor/`,
`worker/`); installed, they are `rtrain.supervisor` and `rtrain.worker`, under the one import
package `rtrain` (`rtrain/`), and nothing else lands in site-packages. Everything else about the
build is in pyproject.toml; only this mapping needs code, so that a new folder ships without a
list to keep."""

from setuptools import find_packages, setup

HALVES = ("supervisor", "worker")

setup(
    package_dir={"rtrain": "rtrain", **{f"rtrain.{half}": half for half in HALVES}},
    packages=["rtrain", *(f"rtrain.{name}"
                          for name in find_packages(include=[f"{half}*" for half in HALVES]))],
)
