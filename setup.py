"""Only what pyproject.toml cannot say: ship ``lmpool_harness.pth`` into site-packages.

Python runs it at start-up; it imports ``lmpool_harness``, which registers the ``lmpool`` model
with lm-evaluation-harness when lm-eval loads its models (lm-eval 0.4.13 reads no entry points).
Regular wheels get the file from ``build_py``; editable installs (``pip install -e``) from
``editable_wheel``, next to setuptools' own ``__editable__`` .pth.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "lmpool_harness.pth"
HERE = Path(__file__).resolve().parent


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(HERE / PTH), str(Path(self.build_lib) / PTH), preserve_mode=False)


class _WithPth:
    """An editable strategy that also writes the .pth into the wheel."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def __call__(self, wheel: Any, files: Any, mapping: Any) -> None:
        self.strategy(wheel, files, mapping)
        wheel.writestr(PTH, (HERE / PTH).read_text())

    def __enter__(self) -> Any:
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.strategy.__exit__(*exc)


class EditableWheelWithPth(editable_wheel):
    def _select_strategy(self, *args: Any, **kwargs: Any) -> Any:
        return _WithPth(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
