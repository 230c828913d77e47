"""What every stage does first (``Stage.open``): load and check ``params.yaml``, refuse a
dataset it does not list, and find the repository (``$DVC_ROOT`` under DVC, else the
params file's folder). The MLflow run (``Stage.tracked``) is covered by the stage tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from rich.console import Console

from quanthunt.errors import ConfigError
from quanthunt.stage import Stage

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def params_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The shipped ``params.yaml`` in a folder of its own, outside any DVC run."""
    monkeypatch.delenv("DVC_ROOT", raising=False)
    (tmp_path / "project").mkdir()
    return Path(shutil.copy(REPO / "params.yaml", tmp_path / "project/params.yaml"))


def test_outside_dvc_the_repository_is_the_params_files_folder(params_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(params_path.parent.parent)
    console = Console()
    stage = Stage.open("survey", Path("project/params.yaml"), console)
    assert stage.root == params_path.parent and stage.root.is_absolute()
    assert stage.name == "survey" and stage.console is console
    assert stage.paths == stage.params.paths and stage.paths.of(stage.root, "chat").generated.is_relative_to(stage.root)


def test_under_dvc_the_repository_is_dvc_root(params_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    assert Stage.open("verify", params_path).root == tmp_path.resolve()


def test_a_dataset_the_params_do_not_list_is_refused_naming_the_file(params_path: Path) -> None:
    assert Stage.open("generate", params_path, dataset="chat").params.datasets[0] == "chat"
    with pytest.raises(ConfigError) as info:
        Stage.open("generate", params_path, dataset="chatt")
    message = str(info.value)
    assert message.startswith(f"{params_path}: datasets has no 'chatt' (it lists chat, multiturn,"), message


def test_a_missing_or_broken_params_file_is_one_line_naming_it(params_path: Path) -> None:
    missing = params_path.with_name("missing.yaml")
    with pytest.raises(ConfigError, match=rf"^{missing}: params file not found$"):
        Stage.open("survey", missing)
    params_path.write_text(params_path.read_text().replace("  seed: 0\n", "  seed: zero\n", 1))
    with pytest.raises(ConfigError) as info:
        Stage.open("survey", params_path)
    assert str(info.value).startswith(f"{params_path}: verify.seed: ")
