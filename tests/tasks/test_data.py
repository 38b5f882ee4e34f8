"""The generated tasks, read back token by token: the answer is where the prompt says it is."""

from __future__ import annotations

import torch

from swa_bench.tasks import data


def test_held_out_text_comes_from_other_files():
    files = data.stdlib_files()
    held = [p for p in files if data.is_held_out(p)]
    assert 0 < len(held) < len(files) / 5
    text = data.corpus("held_out")
    assert text.numel() > 10_000 and int(text.max()) < 127 and int(text.min()) >= 10


def test_recall_prompt_answer_is_the_queried_facts_value():
    g = torch.Generator().manual_seed(0)
    for length, distance in [(16, 8), (64, 40), (256, 240), (256, 4)]:
        p = data.recall_prompt(length, distance, g)
        t = p.tokens
        assert len(t) == length and t[-2] == data.QUERY and p.distance == distance
        facts = {t[i + 1]: (i, t[i + 2]) for i in range(length - 2) if t[i] == data.FACT}
        at, value = facts[t[-1]]
        assert value == p.answer and length - 1 - at == distance
        assert len(facts) == 3 and p.answer in data.VALUES


def test_copy_prompt_answer_continues_the_pattern_inside_the_window():
    g = torch.Generator().manual_seed(1)
    for length in (16, 64, 256):
        p = data.copy_prompt(length, g, window=16)
        t = list(p.tokens)
        start = max(i for i, x in enumerate(t) if x == data.COPY)
        segment = t[start + 1 :] + [p.answer]
        assert length - start <= 16
        period = next(k for k in range(2, 7) if all(segment[i] == segment[i % k]
                                                    for i in range(len(segment))))
        assert len(segment) - 1 >= 2 * period


def test_training_batch_weights_its_answers():
    g = torch.Generator().manual_seed(2)
    tokens, weights = data.training_batch(8, 96, 16, g, max_facts=4)
    assert tokens.shape == (8, 96) and weights.shape == (8, 95)
    for seq, w in zip(tokens.tolist(), weights.tolist(), strict=True):
        values = {seq[i + 1]: seq[i + 2] for i in range(94) if seq[i] == data.FACT}
        copies = []
        for i, weight in enumerate(w):
            if weight == 1.0:
                continue
            if seq[i - 1] == data.QUERY:  # the answer of a query: its fact's value
                assert values[seq[i]] == seq[i + 1]
            else:
                copies.append(i)
        # the copy segment: COPY, one period of symbols, then repetitions, each weighted
        start = seq.index(data.COPY)
        period = copies[0] - start
        assert period >= 2 and copies == list(range(copies[0], copies[0] + len(copies)))
        assert all(seq[i + 1] in data.SYMBOLS for i in copies)
        assert all(seq[i + 1] == seq[i + 1 - period] for i in copies)
