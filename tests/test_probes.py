"""The probe plan: stratified across datasets and reproducible from the seed."""

from __future__ import annotations

from collections import Counter

from quanthunt.probes import select_probes
from quanthunt.prompts import PromptRecord, Turn


def records(prefix: str, n: int) -> list[PromptRecord]:
    return [PromptRecord(f"{prefix}{i}", (Turn("user", f"{prefix} question {i}"),)) for i in range(n)]


def test_probes_are_stratified_and_reproducible() -> None:
    datasets = {"b": records("b", 10), "a": records("a", 10), "c": records("c", 2)}
    probes = select_probes(datasets, count=12, seed=7)
    assert [p.dataset for p in probes[:6]] == ["a", "b", "c", "a", "b", "c"]
    assert Counter(p.dataset for p in probes) == {"a": 5, "b": 5, "c": 2}
    assert probes == select_probes(datasets, count=12, seed=7)
    assert [p.id for p in probes] != [p.id for p in select_probes(datasets, count=12, seed=8)]
    assert probes[0].as_messages() == [{"role": "user", "content": probes[0].messages[0][1]}]
