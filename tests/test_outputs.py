"""Stage outputs written all-or-nothing (real files in tmp_path): staged beside their
targets, renamed into place only when the block succeeds; on failure the staged files go
and whatever was there before is untouched."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from quanthunt.outputs import Outputs, write_atomic


def files_under(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (hidden staged files included) by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_files_appear_together_only_when_the_block_ends(tmp_path: Path) -> None:
    providers, plan = tmp_path / "reports/survey/providers.csv", tmp_path / "reports/survey/budget_plan.json"
    with Outputs() as out:
        out.write_text(providers, "provider,tag\n")
        out.write_json(plan, {"usd": 100})
        assert not providers.exists() and not plan.exists()
        staged = [p.name for p in providers.parent.iterdir()]
        assert len(staged) == 2 and all(name.startswith(".") and name.endswith(".tmp") for name in staged), staged
    assert files_under(tmp_path) == {
        "reports/survey/budget_plan.json": b'{\n  "usd": 100\n}\n',
        "reports/survey/providers.csv": b"provider,tag\n",
    }


def test_a_failure_in_the_block_removes_the_staged_files_and_leaves_the_old_ones(tmp_path: Path) -> None:
    (tmp_path / "old.csv").write_text("previous run\n")
    before = files_under(tmp_path)
    with pytest.raises(RuntimeError, match="the stage failed"), Outputs() as out:
        out.write_text(tmp_path / "old.csv", "half-made\n")
        out.write_text(tmp_path / "new.json", "{}\n")
        raise RuntimeError("the stage failed")
    assert files_under(tmp_path) == before


def test_an_interrupt_discards_too(tmp_path: Path) -> None:
    """Ctrl-C is a ``BaseException``, not an ``Exception``: it must not publish half a stage."""
    with pytest.raises(KeyboardInterrupt), Outputs() as out:
        out.write_text(tmp_path / "metrics.json", "{}\n")
        raise KeyboardInterrupt
    assert files_under(tmp_path) == {}


def test_a_failure_while_staging_discards_what_was_staged_before(tmp_path: Path) -> None:
    (tmp_path / "not-a-folder").write_text("a file")
    with pytest.raises(OSError), Outputs() as out:
        out.write_text(tmp_path / "first.txt", "staged\n")
        out.write_text(tmp_path / "not-a-folder/second.txt", "cannot be staged\n")
    assert files_under(tmp_path) == {"not-a-folder": b"a file"}


def test_a_second_write_to_the_same_path_wins(tmp_path: Path) -> None:
    """Both writes share one staged file: it was moved in by the first rename and the
    second failed, after publishing the other outputs (fixed here)."""
    target = tmp_path / "report.json"
    with Outputs() as out:
        out.write_text(target, "first\n")
        out.write_text(tmp_path / "other.txt", "other\n")
        out.write_text(target, "second\n")
    assert files_under(tmp_path) == {"other.txt": b"other\n", "report.json": b"second\n"}


def test_a_rename_that_fails_at_commit_leaves_no_staged_file_behind(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()  # a folder where a file should go: the rename fails
    with pytest.raises(OSError), Outputs() as out:
        out.write_text(tmp_path / "taken", "cannot replace a folder\n")
        out.write_text(tmp_path / "later.txt", "not reached\n")
    assert files_under(tmp_path) == {}
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_json_is_indented_in_insertion_order_with_a_final_newline_and_dates_as_text(tmp_path: Path) -> None:
    target = tmp_path / "card.json"
    data = {"z": 1, "a": [1.5, None], "when": dt.date(2026, 1, 2), "where": Path("data/final")}
    with Outputs() as out:
        out.write_json(target, data)
    text = target.read_text()
    assert text.endswith("}\n") and text.index('"z"') < text.index('"a"')
    assert json.loads(text) == {"z": 1, "a": [1.5, None], "when": "2026-01-02", "where": "data/final"}


def test_text_is_written_as_utf8(tmp_path: Path) -> None:
    with Outputs() as out:
        out.write_text(tmp_path / "names.txt", "日本語 ☃\n")
    assert (tmp_path / "names.txt").read_bytes() == "日本語 ☃\n".encode()


def test_write_atomic_replaces_the_file_and_makes_its_folder(tmp_path: Path) -> None:
    target = tmp_path / "reports/validate/chat.json"
    write_atomic(target, b"one\n")
    write_atomic(target, b"two\n")
    assert files_under(tmp_path) == {"reports/validate/chat.json": b"two\n"}


def test_write_atomic_that_cannot_rename_leaves_the_target_and_no_staged_file(tmp_path: Path) -> None:
    (tmp_path / "chat.json").mkdir()
    with pytest.raises(OSError):
        write_atomic(tmp_path / "chat.json", b"{}\n")
    assert [p.name for p in tmp_path.iterdir()] == ["chat.json"] and (tmp_path / "chat.json").is_dir()


def test_a_directory_is_replaced_whole_and_only_when_the_block_succeeds(tmp_path: Path) -> None:
    """An earlier run's plot of a provider this run did not audit goes with its directory;
    a failed run leaves the earlier directory as it was."""
    plots = tmp_path / "reports/verify/plots"
    plots.mkdir(parents=True)
    (plots / "gone-provider.png").write_bytes(b"earlier")
    (plots / "alpha.png").write_bytes(b"earlier alpha")
    before = files_under(tmp_path)
    with pytest.raises(RuntimeError, match="the stage failed"), Outputs() as out:
        out.write_dir(plots, {"alpha.png": b"new alpha"})
        raise RuntimeError("the stage failed")
    assert files_under(tmp_path) == before
    with Outputs() as out:
        out.write_dir(plots, {"alpha.png": b"new alpha", "beta.png": b"new beta"})
        assert files_under(plots) == before_plots(before)
    assert files_under(tmp_path) == {"reports/verify/plots/alpha.png": b"new alpha", "reports/verify/plots/beta.png": b"new beta"}


def before_plots(before: dict[str, bytes]) -> dict[str, bytes]:
    return {name.removeprefix("reports/verify/plots/"): data for name, data in before.items()}
