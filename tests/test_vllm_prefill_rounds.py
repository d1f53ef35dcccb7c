"""Prefill chunks are cut into rounds of sub-chunks of <= recent tokens (backend.prefill_rounds)."""

from vllm_oscar.attention.backend import prefill_rounds


def test_rounds_cover_every_prefill_token_once_in_order():
    # 2 decodes (1 token each), then prefills of 5, 1 and 9 tokens; sub-chunks of 4.
    starts = [0, 1, 2, 7, 8, 17]
    seq_lens = [30, 12, 105, 1, 9]
    rounds = prefill_rounds(starts, seq_lens, first=2, sub_chunk=4)
    covered = [row for _, rows, _, _ in rounds for row in rows]
    assert sorted(covered) == list(range(2, 17))
    requests, rows, locs, lens = rounds[0]
    assert requests == [2, 3, 4]
    assert rows == [2, 3, 4, 5, 7, 8, 9, 10, 11]
    assert locs == [0, 4, 5, 9]
    # seq_len of a sub-chunk = tokens before it + its length: request 2 has 100 cached tokens.
    assert lens == [104, 1, 4]
    assert rounds[1][0] == [2, 4] and rounds[1][3] == [105, 8]
    assert rounds[2][0] == [4] and rounds[2][1] == [16] and rounds[2][3] == [9]
    assert len(rounds) == 3


def test_no_prefill_no_rounds():
    assert prefill_rounds([0, 1, 2], [5, 9], first=2, sub_chunk=256) == []
