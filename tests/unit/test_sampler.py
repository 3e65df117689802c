"""Batched sampling: greedy, seeded reproducibility, top-k/top-p, penalties, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from wire.sampling_params import SamplingParams
from workers.detokenizer import TokenTable
from workers.sampler import MASKED_LOGPROB, Sampler, apply_penalties

VOCAB = 50


@dataclass
class Row:
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    grammar: None = None


def seeded(seed: int, **kwargs) -> Row:
    return Row(SamplingParams(**kwargs), torch.Generator().manual_seed(seed))


@pytest.fixture
def sampler() -> Sampler:
    text = tuple(bytes([65 + i % 26]) for i in range(VOCAB))
    return Sampler(TokenTable(text, text))


def logits_for(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def draw(sampler: Sampler, logits: torch.Tensor, rows: list[Row], steps: int) -> list[list[int]]:
    """Sample `steps` times from the same logits; one token list per row."""
    picked: list[list[int]] = [[] for _ in rows]
    for _ in range(steps):
        for i, token in enumerate(sampler.sample(logits, rows).token_ids):
            picked[i].append(token)
    return picked


def test_greedy_is_argmax(sampler: Sampler) -> None:
    logits = logits_for(3)
    rows = [Row(SamplingParams(temperature=0.0)) for _ in range(3)]
    assert sampler.sample(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_takes_the_first_of_tied_maxima_in_any_dtype_as_argmax_does(sampler) -> None:
    """The all-greedy batch skips the float32 copy; bfloat16 logits tie often (8-bit mantissa),
    and `generate` takes the first of the tied tokens."""
    ties = torch.tensor(
        [[1.0, 3.0, 0.5, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 2.0, 3.0, 3.0]]
    )
    wide = torch.zeros(3, VOCAB)
    wide[:, 10:15] = ties
    rows = [Row(SamplingParams(temperature=0.0)) for _ in range(3)]
    for dtype in (torch.float32, torch.bfloat16):
        assert sampler.sample(wide.to(dtype), rows).token_ids == [11, 10, 13]
    noisy = logits_for(8).to(torch.bfloat16)
    rows = [Row(SamplingParams(temperature=0.0)) for _ in range(8)]
    assert sampler.sample(noisy, rows).token_ids == noisy.float().argmax(dim=-1).tolist()


def test_a_greedy_row_beside_a_penalised_one_is_still_the_argmax(sampler: Sampler) -> None:
    logits = logits_for(2)
    logits[1, 7] = logits[1].max() + 1.0  # first by 1.0, and the penalty takes 2
    plain = Row(SamplingParams(temperature=0.0))
    penalised = Row(SamplingParams(temperature=0.0, presence_penalty=2.0))
    penalised.output_ids = [7]
    tokens = sampler.sample(logits, [plain, penalised]).token_ids
    assert tokens[0] == int(logits[0].argmax())
    expected = logits[1].clone()
    expected[7] -= 2.0
    assert tokens[1] == int(expected.argmax()) != 7, "the penalty moved the second row off 7"


def test_same_seed_same_tokens_different_seed_different_tokens(sampler: Sampler) -> None:
    logits = logits_for(1)
    first = draw(sampler, logits, [seeded(7)], 30)[0]
    again = draw(sampler, logits, [seeded(7)], 30)[0]
    other = draw(sampler, logits, [seeded(8)], 30)[0]
    assert first == again
    assert first != other
    assert len(set(first)) > 3  # really sampling, not stuck on one token


def test_batch_composition_does_not_change_a_seeded_rows_tokens(sampler: Sampler) -> None:
    logits = logits_for(4)
    alone = draw(sampler, logits[1:2], [seeded(42, top_p=0.9, top_k=20)], 25)[0]
    crowd = [
        seeded(1, temperature=0.5),
        seeded(42, top_p=0.9, top_k=20),
        Row(SamplingParams(temperature=0.0)),
        seeded(3, presence_penalty=1.0),
    ]
    in_batch = draw(sampler, logits, crowd, 25)[1]
    assert in_batch == alone


def test_top_k_one_equals_greedy(sampler: Sampler) -> None:
    logits = logits_for(5, seed=3)
    rows = [seeded(i, temperature=1.5, top_k=1) for i in range(5)]
    assert draw(sampler, logits, rows, 5) == [[t] * 5 for t in logits.argmax(-1).tolist()]


def test_top_p_keeps_only_the_nucleus(sampler: Sampler) -> None:
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 4], logits[0, 9], logits[0, 11] = 3.0, 2.0, 1.0  # ~0.66, 0.24, 0.09
    tokens = draw(sampler, logits, [seeded(0, top_p=0.8)], 200)[0]
    assert set(tokens) == {4, 9}


def test_top_k_keeps_the_k_best(sampler: Sampler) -> None:
    logits = logits_for(1, seed=5)
    best = set(logits[0].topk(3).indices.tolist())
    tokens = draw(sampler, logits, [seeded(0, top_k=3, temperature=2.0)], 200)[0]
    assert set(tokens) == best


def test_penalties_follow_the_openai_formula() -> None:
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    counts = torch.tensor([0.0, 1.0, 3.0, 0.0])
    out = apply_penalties(logits.clone(), counts, presence=0.5, frequency=0.25)
    assert out.tolist() == [1.0, 1.0 - 0.25 - 0.5, 1.0 - 0.75 - 0.5, 1.0]


def test_penalties_apply_to_generated_tokens_in_the_sampler(sampler: Sampler) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 1.0
    row = Row(SamplingParams(temperature=0.0, frequency_penalty=0.6), output_ids=[2, 2])
    assert sampler.sample(logits, [row]).token_ids == [0]  # 1.0 - 1.2 < 0.0: token 2 loses
    plain = Row(SamplingParams(temperature=0.0), output_ids=[2, 2])
    assert sampler.sample(logits, [plain]).token_ids == [2]


def test_logprobs_shape_and_values(sampler: Sampler) -> None:
    logits = logits_for(2)
    rows = [
        Row(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)),
        Row(SamplingParams(temperature=0.0)),
    ]
    result = sampler.sample(logits, rows)
    entry = result.logprobs[0]
    assert result.logprobs[1] is None
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    expected = logits[0].log_softmax(-1)
    token = result.token_ids[0]
    assert entry["logprob"] == pytest.approx(float(expected[token]))
    assert entry["token"] == chr(65 + token % 26)
    assert entry["bytes"] == [65 + token % 26]
    top = entry["top_logprobs"]
    assert [set(t) for t in top] == [{"token", "logprob", "bytes"}] * 3
    assert [t["logprob"] for t in top] == pytest.approx(expected.topk(3).values.tolist())
    assert top[0]["token"] == entry["token"]  # greedy picks the most likely


def test_logprobs_come_from_the_processed_distribution(sampler: Sampler) -> None:
    logits = logits_for(1)
    row = seeded(0, temperature=0.5, top_k=2, logprobs=True, top_logprobs=4)
    entry = sampler.sample(logits, [row]).logprobs[0]
    expected = (logits[0] / 0.5).topk(2).values.log_softmax(-1).tolist()
    assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
        [*expected, MASKED_LOGPROB, MASKED_LOGPROB]
    )
