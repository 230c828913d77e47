"""Making again the records a provider found bad later served.

A provider re-verified ``different`` after it served records, or stopped by its monitor
(its replies from the suspect checkpoint on are quarantined), leaves a dataset that
validate refuses or trims; before this, ``generate`` said "0 new" and bought nothing to
replace them. At the start of each run (``set_aside``), generate finds every record with
a turn such a provider served (``to_replace``) and sets it aside:

- its line moves to the ledger's ``replaced_records`` and to
  ``<generating>/replaced/<dataset>-<params>.jsonl``: what was paid for is kept, never
  deleted, and the card counts it;
- its turns from the first bad one on are no longer done (their replies are not reused);
  the turns before it stay done, so the run makes only the rest again, from the providers
  still eligible (the record's cost then counts every attempt, the replaced ones too);
- the working file is rewritten without it (atomically), so the run makes it again.

Each step can be repeated: a run that dies between them finds the same records at its
next start and sets them aside again (the ledger and the file keep one copy each).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from quanthunt.ledger import Ledger, ReplaceRecords
from quanthunt.monitor import suspect_turn
from quanthunt.outputs import write_atomic
from quanthunt.records import sha256_line
from quanthunt.verdicts import Verdicts


@dataclass(frozen=True)
class Replacement:
    """A record to make again from turn ``from_turn`` on, because of endpoint ``tag``."""

    record_id: str
    from_turn: int
    tag: str
    why: str
    line: str


def bad_endpoints(verdicts: Verdicts) -> dict[str, str]:
    """Endpoint tag → why its turns are made again: every provider the current verdicts
    call ``different`` (re-verified after it served, or never eligible)."""
    return {
        v.tag: f"{v.tag} is verified different (verification {verdicts.verification_run_id})"
        for v in verdicts.providers
        if v.verdict == "different"
    }


def to_replace(lines: Iterable[str], *, bad: Mapping[str, str], suspect: Mapping[str, int]) -> list[Replacement]:
    """The records among ``lines`` with a turn from a ``bad`` endpoint (tag → why), or from
    a stopped one at or after its first suspect checkpoint (``suspect``: tag → checkpoint,
    as validate quarantines them; a turn without a monitor stamp counts as after), each
    from its first such turn."""
    found = []
    for line in lines:
        entry = json.loads(line)
        for index, turn in enumerate((entry.get("provenance") or {}).get("turns") or []):
            if not isinstance(turn, dict):
                continue
            tag = str(turn.get("endpoint_tag"))
            if tag in bad:
                why = bad[tag]
            elif suspect_turn(turn, suspect):  # what validate quarantines
                why = f"{tag} was stopped by its monitor: its replies from checkpoint {suspect[tag]} on are suspect"
            else:
                continue
            found.append(Replacement(str(entry["id"]), index, tag, why, line))
            break
    return found


def set_aside(ledger: Ledger, working: Path, aside: Path, *, dataset: str, params_hash: str,
              replacements: Sequence[Replacement]) -> None:  # fmt: skip
    """Set ``replacements`` aside (see the module docstring): the ledger first, then the
    ``aside`` file, then ``working`` rewritten without them."""
    if not replacements:
        return
    ledger.write(ReplaceRecords(dataset, params_hash, [(r.record_id, r.from_turn, r.why) for r in replacements]))
    kept = {sha256_line(line) for line in aside.read_text(encoding="utf-8").splitlines()} if aside.exists() else set()
    new = [r.line for r in replacements if sha256_line(r.line) not in kept]
    if new:
        aside.parent.mkdir(parents=True, exist_ok=True)
        with aside.open("a", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in new))
            fh.flush()
            os.fsync(fh.fileno())
    gone = {r.record_id for r in replacements}
    staying = [line for line in working.read_text(encoding="utf-8").splitlines() if json.loads(line)["id"] not in gone]
    write_atomic(working, "".join(line + "\n" for line in staying).encode())


def describe(replacements: Sequence[Replacement]) -> str:
    """``12 records (beta/int4 ×12)``, for the terminal."""
    by = Counter(r.tag for r in replacements)
    total = len(replacements)
    return f"{total} record{'' if total == 1 else 's'} (" + ", ".join(f"{tag} ×{n}" for tag, n in sorted(by.items())) + ")"
