"""What the audit measures: pairing of logprobs, the sampler check, and the rank score's
null distribution (decisions: ``test_decision.py``)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from quanthunt.measurements import (
    compare_logprobs,
    pit_normal_score,
    rank,
    tempered_logprob_bounds,
    tempered_pit_normal_score,
)
from quanthunt.reference import Position, Scored
from quanthunt.replies import TokenLogprob


def token(text: str, logprob: float, top: dict[str, float] | None = None) -> TokenLogprob:
    return TokenLogprob.model_validate(
        {
            "token": text,
            "logprob": logprob,
            "top_logprobs": [{"token": t, "logprob": v} for t, v in (top or {text: logprob}).items()],
        }
    )


def position(token_id: int, logprob: float, top: dict[str, float], names: dict[int, str]) -> Position:
    """A position scored by id (vLLM ``return_tokens_as_token_ids``), alternatives named ``names``."""
    ids = {name: i for i, name in names.items()}
    keyed: dict[int | str, float] = {ids[name]: value for name, value in top.items()}
    return Position(token_id, logprob, keyed, token_id, {i: names[i] for i in keyed} | {token_id: names[token_id]})


NAMES = {1: "Hi", 2: " there", 3: " you", 4: " friend", 5: "!", 6: "", 7: "", 8: " ê"}


def test_pairing_stops_at_the_first_tokenization_mismatch() -> None:
    scored = Scored(
        token_ids=[0, 1, 2, 4, 5],
        positions=[
            None,
            position(1, -1.0, {"Hi": -1.0}, NAMES),
            position(2, -0.5, {" there": -0.5, " you": -1.2}, NAMES),
            position(4, -0.25, {" friend": -0.25}, NAMES),
            position(5, -2.0, {"!": -2.0}, NAMES),
        ],
    )
    provider = [token(" there", -0.4, {" there": -0.4, " you": -1.3}), token(" fri", -0.3), token("end", -0.1)]
    paired = compare_logprobs("p", 0, provider, scored, prompt_len=2, listed=2, horizon=64)
    assert paired.aligned == 1 and paired.tokens == 3
    assert paired.deltas == pytest.approx([0.1])
    identical = compare_logprobs(
        "p", 0, [token(" there", -0.5, {" there": -0.5, " you": -1.2})], scored, prompt_len=2, listed=2, horizon=64
    )
    assert identical.deltas == [0.0] and identical.kls == [0.0] and identical.top1_agree == [True]


def test_partial_utf8_pieces_pair_and_an_identical_provider_has_zero_kl() -> None:
    """vLLM names a piece of a character ``""``; a server that decodes it alone shows U+FFFD.
    Two pieces named alike are one outcome on both sides (their mass summed), so a provider
    identical to the reference pairs every token and has KL 0 (before: pairing stopped at
    the first piece, and same-named alternatives collided)."""
    pieces = Position(6, -0.7, {6: -0.7, 8: -1.0, 7: -1.9}, 6, {6: "\ufffd", 8: " ê", 7: ""})
    scored = Scored(token_ids=[0, 6, 8], positions=[None, pieces, Position(8, -0.1, {8: -0.1, 6: -2.5}, 8, NAMES)])
    provider = [
        TokenLogprob.model_validate({"token": "", "logprob": -0.7, "top_logprobs": [
            {"token": "", "logprob": -0.7}, {"token": " ê", "logprob": -1.0}, {"token": "", "logprob": -1.9}]}),
        token(" ê", -0.1, {" ê": -0.1, "": -2.5}),
    ]  # fmt: skip
    paired = compare_logprobs("p", 0, provider, scored, prompt_len=1, listed=2, horizon=64)
    assert paired.aligned == 2
    assert paired.deltas == [0.0, 0.0]
    assert paired.kls == pytest.approx([0.0, 0.0], abs=1e-12)


def test_a_character_sampled_byte_by_byte_ends_the_pairing() -> None:
    """The provider sampled " ê" as two byte pieces; the reference re-tokenizes the text with
    the whole character (one token). Pairing the first piece with " ê" would shift every later
    position by one and compare unrelated logprobs (measured: a faithful provider's reply
    came out extreme). It stops there instead."""
    scored = Scored(
        token_ids=[0, 2, 8, 5],
        positions=[
            None,
            position(2, -0.5, {" there": -0.5}, NAMES),
            position(8, -0.2, {" ê": -0.2}, NAMES),
            position(5, -0.3, {"!": -0.3}, NAMES),
        ],
    )
    provider = [token(" there", -0.5), token("\ufffd", -4.0, {"\ufffd": -4.0}), token("\ufffd", -0.01, {"\ufffd": -0.01}),
                token("!", -0.3)]  # fmt: skip
    paired = compare_logprobs("p", 0, provider, scored, prompt_len=1, listed=1, horizon=64)
    assert paired.aligned == 1 and paired.deltas == [0.0]


def test_a_whole_token_against_a_reference_piece_is_paired_only_if_the_text_comes_back_in_step() -> None:
    """Measured on the sandbox: the provider sampled " " then "¾"; the reference re-tokenized
    " ¾" as a piece (space and the first byte) and the rest. The piece paired with " " (Δ 12)
    and the mean |Δ| of a faithful reply came out 0.81, extreme. The text named so far no
    longer agrees after that pair, so it is dropped."""
    names = {1: " a", 2: "", 3: " ¾", 4: "-"}
    scored = Scored(
        token_ids=[0, 1, 2, 3, 4],
        positions=[None, position(1, -1.0, {" a": -1.0}, names), position(2, -14.4, {"": -14.4}, names),
                   position(3, -11.0, {" ¾": -11.0}, names), position(4, -7.3, {"-": -7.3}, names)],
    )  # fmt: skip
    provider = [token(" a", -1.0), token(" ", -2.3), token("¾", -4.8), token("-", -0.7)]
    paired = compare_logprobs("p", 0, provider, scored, prompt_len=1, listed=1, horizon=64)
    assert paired.aligned == 1 and paired.deltas == [0.0]


def test_a_chat_list_of_k_minus_one_is_compared_at_the_same_depth() -> None:
    """vLLM's chat lists the sampled token first and only the top k−1 when the sampled token
    is outside the top k; its echo lists the top k plus the scored token. Compared at the same
    depth, an identical provider has KL 0 (at unequal depth it did not)."""
    names = {1: "a", 2: "b", 3: "c", 4: "z"}
    scored = Scored([0, 4], [None, position(4, -4.0, {"z": -4.0, "a": -0.5, "b": -1.5, "c": -2.0}, names)])
    provider = [
        TokenLogprob.model_validate({"token": "z", "logprob": -4.0, "top_logprobs": [
            {"token": "z", "logprob": -4.0}, {"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.5}]})
    ]  # fmt: skip
    paired = compare_logprobs("p", 0, provider, scored, prompt_len=1, listed=2, horizon=64)
    assert paired.kls == [0.0]
    assert paired.top1_agree == [True]


def test_the_sampler_check_scores_the_provider_tokens_rank_under_the_reference() -> None:
    """Logprob mode's rank z: the reference's favourite token every time (a cold or greedy
    sampler) scores far below 0, a token it ranks outside its top every time far above."""
    names = {1: "a", 2: "b", 3: "c", 4: "z"}

    def run(sampled: int, logprob: float) -> float:
        top = {"a": math.log(0.5), "b": -2.0, "c": -3.0} | {names[sampled]: logprob}
        scored = Scored([0] + [sampled] * 64, [None] + [position(sampled, logprob, top, names)] * 64)
        provider = [token(names[sampled], logprob, {names[sampled]: logprob})] * 64
        return compare_logprobs("p", 0, provider, scored, prompt_len=1, listed=3, horizon=64).rank_z

    assert run(1, math.log(0.5)) < -3.0  # always the favourite (mass 0.5): every PIT below ½
    assert run(4, -6.0) > 3.0  # always outside the top 3 (mass 0.69): every PIT above 0.69


@pytest.mark.parametrize("layout", ["vllm", "sglang", "vllm-by-name"])
def test_pit_normal_scores_are_standard_normal_for_the_references_own_samples(layout: str) -> None:
    """Draw tokens from a known distribution and score them by its top 3 as each server lists
    them (vLLM: the top 3, plus the scored token when outside them; SGLang: the top 3 only):
    the scores are N(0, 1) either way, and a tail token's share beyond z 1.96 is 2.5 % (reading
    membership from the list's length scored SGLang's tail tokens as in the top)."""

    probs = {"a": 0.5, "b": 0.2, "c": 0.15, "d": 0.1, "e": 0.05}
    ids = {t: i for i, t in enumerate(probs)}
    top3 = {ids[t]: math.log(p) for t, p in list(probs.items())[:3]}
    rng = random.Random(0)
    scores = []
    for _ in range(4000):
        token = rng.choices(list(probs), weights=list(probs.values()))[0]
        logprob = math.log(probs[token])
        top: dict[int | str, float] = dict(top3) if layout == "sglang" else {ids[token]: logprob} | top3
        if layout == "vllm-by-name":
            top = {chr(97 + int(k)): v for k, v in top.items()}
        key: int | str = token if layout == "vllm-by-name" else ids[token]
        scores.append(pit_normal_score(Position(ids[token], logprob, top, key), listed=3, u=rng.random()))
    assert abs(statistics.fmean(scores)) < 0.05 and abs(statistics.stdev(scores) - 1) < 0.05
    assert abs(sum(1 for z in scores if z > 1.96) / len(scores) - 0.025) < 0.008


def exact_samples(count: int, *, min_tokens: int, max_tokens: int, seed: int) -> list[list[Position]]:
    """Completions the reference's own sampler draws from a small model whose stop token
    (id 0) is likeliest right after a full stop and never before ``min_tokens``: what each
    sampled token's position looks like to the scorer (the top 3, plus the token)."""
    rng = random.Random(seed)
    completions = []
    for _ in range(count):
        positions: list[Position] = []
        last = 1
        while len(positions) < max_tokens:
            stop = 0.0 if len(positions) < min_tokens else (0.9 if last == 5 else 0.02)
            rest = [0.4, 0.25, 0.15, 0.1, 0.1]  # tokens 1..5; 5 is the full stop
            probs = [stop] + [(1 - stop) * p for p in rest]
            drawn = rng.choices(range(6), weights=probs)[0]
            logs = {i: math.log(p) for i, p in enumerate(probs) if p > 0}
            top3: dict[int | str, float] = dict(sorted(logs.items(), key=lambda kv: -kv[1])[:3])
            positions.append(Position(drawn, logs[drawn], {drawn: logs[drawn]} | top3, drawn))
            if drawn == 0:
                break
            last = drawn
        completions.append(positions)
    return completions


def test_rank_z_is_standard_normal_for_exact_samples_whatever_stops_them() -> None:
    """Exact samples of 5 to 64 tokens whose length the text decides (a stop after a full
    stop): with the stop token scored and the rest padded to the horizon, Φ(z) has mean ½ and
    P(z > 2) is 1 − Φ(2) = 0.0228; the pit (the padding averaged out) has mean ½ too, at less
    than half Φ(z)'s variance. Leaving the stop token out and dividing by √tokens (the
    statistic before) is biased upwards."""
    samples = exact_samples(20_000, min_tokens=4, max_tokens=64, seed=1)
    lengths = [len(s) for s in samples]
    assert min(lengths) == 5 and max(lengths) == 64 and statistics.median(lengths) == 11
    ranks = [rank(s, listed=3, seed=f"s{i}", horizon=64) for i, s in enumerate(samples)]
    z = [r.z for r in ranks]
    normal = statistics.NormalDist()
    assert abs(statistics.fmean(normal.cdf(v) for v in z) - 0.5) < 0.0065  # 3.2 standard errors of 20,000 uniforms
    assert abs(sum(v > 2 for v in z) / len(z) - 0.0228) < 0.0034  # 3.2 standard errors
    pit = [r.pit for r in ranks]
    assert abs(statistics.fmean(pit) - 0.5) < 0.004 and statistics.variance(pit) < 0.5 / 12
    rng = random.Random(2)
    before = [
        math.fsum(pit_normal_score(p, listed=3, u=rng.random()) for p in s if p.token_id != 0)
        / math.sqrt(sum(p.token_id != 0 for p in s))
        for s in samples
    ]
    assert statistics.fmean(normal.cdf(v) for v in before) > 0.515  # measured 0.525, 12 standard errors off ½


def test_rank_z_reads_only_its_horizon_and_pads_the_rest_reproducibly() -> None:
    [sample] = exact_samples(1, min_tokens=40, max_tokens=40, seed=3)
    whole = rank(sample, listed=3, seed="a", horizon=16)
    assert whole == rank(sample[:16], listed=3, seed="a", horizon=16)
    assert whole.pit == pytest.approx(statistics.NormalDist().cdf(whole.z))  # nothing padded
    short = rank(sample[:5], listed=3, seed="a", horizon=16)
    assert short == rank(sample[:5], listed=3, seed="a", horizon=16)
    assert short.z != rank(sample[:5], listed=3, seed="b", horizon=16).z
    with pytest.raises(ValueError, match="horizon"):
        rank(sample, listed=3, seed="a", horizon=0)


def test_a_stop_token_the_provider_did_not_list_is_still_ranked() -> None:
    """vLLM lists the stop token last among a stopped reply's logprobs and it pairs like any
    other; a provider that leaves it out still sampled it, so the rank statistic scores the
    reference's position for it once the pairing reached the end of what was listed."""
    names = {1: "Hi", 2: " there", 9: "<|im_end|>"}
    top = {"Hi": -0.1, " there": -0.2, "<|im_end|>": -3.0}
    scored = Scored([0, 1, 2, 9], [None] + [position(i, top[names[i]], top, names) for i in (1, 2, 9)])
    listed = [token("Hi", -0.1, top), token(" there", -0.2, top)]
    stopped = compare_logprobs("p", 0, listed, scored, prompt_len=1, listed=3, horizon=8, stopped=True)
    cut = compare_logprobs("p", 0, listed, scored, prompt_len=1, listed=3, horizon=8, stopped=False)
    with_stop = compare_logprobs("p", 0, [*listed, token("<|im_end|>", -3.0, top)], scored, prompt_len=1, listed=3,
                                 horizon=8, stopped=True)  # fmt: skip
    assert stopped.deltas == cut.deltas == [0.0, 0.0] and with_stop.deltas == [0.0, 0.0, 0.0]
    assert (stopped.rank_z, stopped.rank_pit) == (with_stop.rank_z, with_stop.rank_pit) != (cut.rank_z, cut.rank_pit)


def tempered_samples(count: int, *, sampled_at: float, tokens: int, seed: int) -> list[list[Position]]:
    """Texts drawn at temperature ``sampled_at`` from a 60-token model whose positions range
    from flat to peaked (Zipf exponents 0.6–1.6: up to ~40 % of the raw mass outside the top
    5), each position as the reference lists it (its raw top 5, plus the token)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        positions = []
        for _ in range(tokens):
            steep = rng.uniform(0.6, 1.6)
            raw = [1.0 / (i + 1) ** steep for i in range(60)]
            probs = [p / sum(raw) for p in raw]
            drawn = rng.choices(range(60), weights=[p ** (1 / sampled_at) for p in probs])[0]
            logs = {i: math.log(p) for i, p in enumerate(probs)}
            top: dict[int | str, float] = {i: logs[i] for i in range(5)}
            positions.append(Position(drawn, logs[drawn], top | {drawn: logs[drawn]}, drawn))
        texts.append(positions)
    return texts


def test_the_tempered_rank_is_exact_for_a_sampler_at_the_generations_temperature() -> None:
    """The generate stage's monitor ranks replies sampled at T 0.7 by the reference's raw top
    logprobs (20; here 5, the harder case: up to ~40 % of the raw mass unlisted), whose
    tempered normaliser it cannot know.
    Ranked within the top, a tail token scoring a draw apart from the text, a sampler at 0.7
    gives mean pit ½ and P(z > 2) = 1 − Φ(2) (measured 0.5006 and 0.0208 over 4,000 texts);
    one at 1.0 (a +0.3 drift) is far above ½ and one at 0.5 far below. A token outside the
    top scores its draw at 0.7; at temperature 1 the tail is ranked last instead."""
    exact = [rank(t, listed=5, seed=f"e{i}", horizon=16, temperature=0.7)
             for i, t in enumerate(tempered_samples(4000, sampled_at=0.7, tokens=12, seed=1))]  # fmt: skip
    pits = [r.pit for r in exact]
    assert abs(statistics.fmean(pits) - 0.5) < 3.2 * statistics.stdev(pits) / math.sqrt(len(pits))
    assert abs(sum(r.z > 2 for r in exact) / len(exact) - 0.0228) < 3.2 * math.sqrt(0.0228 * 0.9772 / len(exact))
    hot = [rank(t, listed=5, seed=f"h{i}", horizon=16, temperature=0.7).pit
           for i, t in enumerate(tempered_samples(500, sampled_at=1.0, tokens=12, seed=2))]  # fmt: skip
    cold = [rank(t, listed=5, seed=f"c{i}", horizon=16, temperature=0.7).pit
            for i, t in enumerate(tempered_samples(500, sampled_at=0.5, tokens=12, seed=3))]  # fmt: skip
    assert statistics.fmean(hot) > 0.56 and statistics.fmean(cold) < 0.36  # measured 0.600 and 0.320
    untempered = [rank(t, listed=5, seed=f"e{i}", horizon=16).pit
                  for i, t in enumerate(tempered_samples(500, sampled_at=0.7, tokens=12, seed=1))]  # fmt: skip
    assert statistics.fmean(untempered) < 0.3  # the T = 1 rank calls a faithful sampler at 0.7 cold (0.18)
    [text] = tempered_samples(1, sampled_at=1.0, tokens=12, seed=4)
    tail = next(p for p in text if not p.in_top(5))
    drawn = statistics.NormalDist().inv_cdf(0.3)
    assert tempered_pit_normal_score(tail, listed=5, u=0.3, temperature=0.7) == pytest.approx(drawn)
    assert pit_normal_score(tail, listed=5, u=0.3) > drawn  # at T 1 the tail is ranked, after the listed mass
    with pytest.raises(ValueError, match="temperature"):
        rank(text, listed=5, seed="t", horizon=16, temperature=1.3)


def _distribution(rng: random.Random, vocab: int) -> list[float]:
    """Log-probabilities of a vocabulary with a heavy head and a long tail, as a model's."""
    logits = [rng.gauss(0.0, 1.0) * 3.0 for _ in range(vocab)]
    top = max(logits)
    total = math.log(math.fsum(math.exp(v - top) for v in logits)) + top
    return [v - total for v in logits]


def _tempered(logp: list[float], temperature: float) -> list[float]:
    scaled = [v / temperature for v in logp]
    top = max(scaled)
    total = math.log(math.fsum(math.exp(v - top) for v in scaled)) + top
    return [v - total for v in scaled]


def _step(logp: list[float], chosen: int, listed: int, reported: list[float]) -> tuple[Position, TokenLogprob]:
    """The reference's position (its raw top ``listed``) and a provider's token whose
    logprobs are ``reported`` (raw or after temperature), top 5, tokens named t0, t1, ..."""
    names = {i: f"t{i}" for i in range(len(logp))}
    order = sorted(range(len(logp)), key=lambda i: -logp[i])
    top = {names[i]: logp[i] for i in order[:listed]} | {names[chosen]: logp[chosen]}
    shown = {names[i]: reported[i] for i in sorted(range(len(logp)), key=lambda i: -reported[i])[:5]}
    return position(chosen, logp[chosen], top, names), token(names[chosen], reported[chosen], shown)


def test_tempered_logprob_bounds_hold_the_true_value_and_close_on_a_full_list() -> None:
    rng = random.Random(7)
    widths = []
    for _ in range(300):
        logp = _distribution(rng, 200)
        temperature = rng.choice([0.3, 0.5, 0.7, 0.9])
        chosen = rng.randrange(200)
        at, _ = _step(logp, chosen, 20, logp)
        low, high = tempered_logprob_bounds(at, temperature)
        truth = _tempered(logp, temperature)[chosen]
        assert low - 1e-9 <= truth <= high + 1e-9
        widths.append(high - low)
        whole, _ = _step(logp, chosen, 200, logp)
        assert tempered_logprob_bounds(whole, temperature) == pytest.approx((truth, truth), abs=1e-9)
    assert statistics.median(widths) < 0.05  # the top 20 hold most of a tempered distribution
    with pytest.raises(ValueError, match="temperature in"):
        tempered_logprob_bounds(at, 1.0)


def test_logprobs_after_temperature_are_read_as_such_and_a_faithful_provider_shows_no_delta() -> None:
    """A provider that reports its logprobs after temperature (vLLM ``processed_logprobs``)
    at T 0.7, read as raw, shows a mean |Δ| far above the 0.08 margin although it samples
    the reference's own distribution; read as processed (its gaps' slope 1/T), its Δs
    vanish. A raw provider stays raw, and a coarse one (its logits perturbed) shows in
    either reading."""
    rng = random.Random(11)
    temperature = 0.7
    results: dict[str, list[float]] = {"raw": [], "processed": [], "unread": [], "coarse": []}
    conventions: dict[str, set[str]] = {key: set() for key in results}
    for text in range(40):
        steps = {key: [] for key in results}
        for _ in range(16):
            logp = _distribution(rng, 200)
            chosen = rng.choices(range(200), weights=[math.exp(v) for v in _tempered(logp, temperature)])[0]
            noisy = _tempered([v + rng.gauss(0.0, 0.6) for v in logp], temperature)
            steps["raw"].append(_step(logp, chosen, 20, logp))
            steps["processed"].append(_step(logp, chosen, 20, _tempered(logp, temperature)))
            steps["unread"].append(steps["processed"][-1])
            steps["coarse"].append(_step(logp, chosen, 20, noisy))
        for key, pairs in steps.items():
            scored = Scored([0, *(p.token_id for p, _ in pairs)], [None, *(p for p, _ in pairs)])
            read_at = None if key == "unread" else temperature
            paired = compare_logprobs("p", text, [t for _, t in pairs], scored, prompt_len=1, listed=20, horizon=16,
                                      temperature=temperature, processed_at=read_at)  # fmt: skip
            results[key].append(paired.mean_abs_delta)
            conventions[key].add(paired.convention)
    assert conventions["raw"] == {"raw"} and conventions["processed"] == {"processed"} and conventions["unread"] == {"raw"}
    assert max(results["raw"]) < 1e-9 and max(results["processed"]) < 1e-9
    assert statistics.fmean(results["unread"]) > 0.2  # the false alarm this reading prevents
    assert statistics.fmean(results["coarse"]) > 0.2
