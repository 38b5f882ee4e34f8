"""The generated tasks, read back token by token: the answer is where the prompt says it is."""

from __future__ import annotations

import sys

import torch

from swa_bench.tasks import data


def _bytes(t: torch.Tensor) -> bytes:
    return t.to(torch.uint8).numpy().tobytes()


def test_held_out_text_is_shipped_and_none_of_it_is_trained_on():
    files = data.stdlib_files()
    held = [p for p in files if data.is_held_out(p)]
    assert 0 < len(held) < len(files) / 5
    text, train = _bytes(data.corpus("held_out")), _bytes(data.corpus("train"))
    assert len(text) == data.TEXT_BYTES // 10
    assert set(text) <= set(data.ascii_text(bytes(range(256))))
    # 200-byte passages of the held-out text: few are in the training text (the library
    # repeats itself: distutils' compilers share code, 4 of these 64 on 3.11.7); a split that
    # leaked would find most
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(text) - 200, (64,), generator=g).tolist()
    assert sum(text[s : s + 200] in train for s in starts) <= 8
    if sys.version_info[:3] == (3, 11, 7):  # the library it was made from: byte for byte
        assert text == data.stdlib_text("held_out")


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
