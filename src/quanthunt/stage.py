"""What every stage does first: read ``params.yaml``, find the repository, open the
console; and how it opens its MLflow run. ``stages/*.py`` start with ``Stage.open``.

Usage::

    stage = Stage.open("validate", params_path, console, dataset="chat")
    with stage.tracked(stage.params.validate_) as run:
        ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel
from rich.console import Console

from quanthunt.params import Params, Paths, load_params
from quanthunt.terminal import stage_console
from quanthunt.tracking import StageRun, repo_root, stage_run


@dataclass(frozen=True)
class Stage:
    name: str
    params: Params
    root: Path
    """The repository: ``$DVC_ROOT`` under DVC, else the params file's folder."""
    console: Console

    @classmethod
    def open(cls, name: str, params_path: Path, console: Console | None = None, *, dataset: str | None = None) -> Stage:
        """Load and check the params (``dataset`` must be one of ``datasets``)."""
        params = load_params(params_path)
        if dataset is not None:
            params.check_dataset(dataset, source=params_path)
        return cls(name, params, repo_root(params_path), console or stage_console())

    def with_params(self, params: Params) -> Stage:
        """The same stage run with ``params`` (verify's calibrated margins: ``calibration_run.applied``)."""
        return dataclasses.replace(self, params=params)

    @property
    def paths(self) -> Paths:
        return self.params.paths

    @contextmanager
    def tracked(self, section: BaseModel) -> Iterator[StageRun]:
        """The stage's MLflow run, tagged with the digest of its own params ``section``."""
        with stage_run(self.name, params=self.params, section=section, root=self.root,
                       experiment=self.params.tracking.experiment) as run:  # fmt: skip
            yield run
