"""The one-writer lock (a real ``flock`` on a file in tmp_path): a second holder, here a
child process, is refused with a clear error naming the holder; the kernel frees the lock
when its holder dies, even by SIGKILL, so a stale lock never blocks a resume."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from quanthunt.errors import EXIT_BAD_INPUT, QuanthuntError
from quanthunt.locking import Busy, exclusive

HOLD = """
import sys
from pathlib import Path
from quanthunt.locking import exclusive
with exclusive(Path(sys.argv[1]), what="generate chat"):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin (or kills us)
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A child process holding ``tmp_path/state/locks/chat.lock`` until it is killed or let go."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "state/locks/chat.lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "held\n"
    yield child
    if child.poll() is None:
        child.kill()
    child.wait(timeout=30)


def test_a_second_holder_is_refused_naming_the_first_ones_pid(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    with pytest.raises(Busy) as info, exclusive(tmp_path / "state/locks/chat.lock", what="generate chat"):
        pytest.fail("the lock was taken twice")
    message = str(info.value)
    assert message == f"generate chat is already running (pid {holder.pid}); wait for it to finish or stop it"
    assert isinstance(info.value, QuanthuntError) and info.value.exit_code == EXIT_BAD_INPUT


def test_the_lock_is_free_again_once_its_holder_is_killed(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    lock = tmp_path / "state/locks/chat.lock"
    with exclusive(lock, what="generate chat"):
        assert lock.read_text() == f"{os.getpid()}\n"  # the dead holder's pid overwritten, not appended to


def test_the_lock_is_free_again_when_its_holder_leaves_the_block(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    assert holder.stdin is not None
    holder.stdin.close()
    assert holder.wait(timeout=30) == 0
    with exclusive(tmp_path / "state/locks/chat.lock", what="generate chat"):
        pass


def test_two_holders_in_one_process_are_refused_too(tmp_path: Path) -> None:
    """A second ``exclusive`` on the same file opens its own descriptor, which ``flock`` refuses."""
    lock = tmp_path / "verify.lock"
    with exclusive(lock, what="verify"):
        with pytest.raises(Busy, match=rf"^verify is already running \(pid {os.getpid()}\)"), exclusive(lock, what="verify"):
            pass
        assert lock.read_text() == f"{os.getpid()}\n"
    with exclusive(lock, what="verify"):  # released by the first block's end
        pass


def test_a_longer_stale_pid_is_replaced_whole(tmp_path: Path) -> None:
    lock = tmp_path / "chat.lock"
    lock.write_text("4194304999\n")  # left by a dead holder; longer than any pid of ours
    with exclusive(lock, what="generate chat"):
        assert lock.read_text() == f"{os.getpid()}\n"


def test_a_holder_that_wrote_no_pid_is_named_as_another_process(tmp_path: Path) -> None:
    lock = tmp_path / "chat.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, nothing written yet
        with pytest.raises(Busy) as info, exclusive(lock, what="generate chat"):
            pass
    finally:
        os.close(fd)
    assert str(info.value).startswith("generate chat is already running (by another process);")


def test_the_lock_folder_is_made_and_an_error_in_the_block_releases_the_lock(tmp_path: Path) -> None:
    lock = tmp_path / "state/locks/code.lock"
    with pytest.raises(RuntimeError), exclusive(lock, what="generate code"):
        raise RuntimeError("the stage failed")
    with exclusive(lock, what="generate code"):
        assert lock.is_file()
