import numpy as np
import pytest

from eagle3_assets.vocab_map import (
    VocabMap,
    build_vocab_map,
    sticky_vocab_map,
    token_frequencies,
    vocab_map_problems,
)


def test_token_frequencies_count_only_loss_masked_positions():
    ids = np.array([5, 5, 1, 2, 5, 3, 3, 0], dtype=np.int32)
    mask = np.array([1, 1, 0, 1, 0, 1, 1, 1], dtype=np.uint8)
    assert token_frequencies(ids, mask, 8).tolist() == [1, 0, 1, 2, 0, 2, 0, 0]


def test_token_frequencies_reject_ids_outside_vocab():
    with pytest.raises(ValueError, match="token id 9 outside the target vocabulary of 8"):
        token_frequencies(np.array([9], dtype=np.int32), np.array([1], dtype=np.uint8), 8)


def test_exact_d2t_t2d_on_hand_made_counts():
    #            id: 0  1  2  3  4  5  6  7  8  9
    freq = np.array([0, 9, 0, 4, 7, 0, 2, 0, 8, 1], dtype=np.int64)
    vmap = build_vocab_map(freq, 4)
    # top 4 by count: 1 (9), 8 (8), 4 (7), 3 (4) -> used = [1, 3, 4, 8]
    assert vmap.d2t.tolist() == [1, 2, 2, 5]
    assert np.flatnonzero(vmap.t2d).tolist() == [1, 3, 4, 8]
    assert vmap.d2t.dtype == np.int64 and vmap.t2d.dtype == np.bool_
    assert vmap_problems_free(vmap, 4, 10)


def test_ties_take_the_lower_id_first():
    freq = np.array([3, 5, 3, 3, 5, 1], dtype=np.int64)
    # 1 and 4 (count 5), then the count-3 ids 0, 2, 3: the lower ids 0 and 2 win
    vmap = build_vocab_map(freq, 4)
    assert np.flatnonzero(vmap.t2d).tolist() == [0, 1, 2, 4]
    assert vmap.d2t.tolist() == [0, 0, 0, 1]


def test_pads_with_lowest_unused_ids_when_corpus_has_fewer_distinct_tokens():
    freq = np.zeros(12, dtype=np.int64)
    freq[[7, 10]] = [4, 2]
    vmap = build_vocab_map(freq, 5)
    # 7 and 10 used, then the lowest unused ids 0, 1, 2
    assert np.flatnonzero(vmap.t2d).tolist() == [0, 1, 2, 7, 10]
    assert vmap.d2t.tolist() == [0, 0, 0, 4, 6]


def test_invariant_holds_on_random_corpora():
    rng = np.random.default_rng(0)
    for _ in range(20):
        vocab = int(rng.integers(50, 500))
        draft = int(rng.integers(1, vocab))
        freq = rng.integers(0, 5, size=vocab).astype(np.int64)
        vmap = build_vocab_map(freq, draft)
        assert np.array_equal(np.flatnonzero(vmap.t2d), vmap.d2t + np.arange(draft))
        # every chosen id is at least as frequent as every id left out
        assert freq[vmap.t2d].min() >= freq[~vmap.t2d].max(initial=0)


def test_draft_vocab_larger_than_target_is_refused():
    with pytest.raises(ValueError, match="draft_vocab_size 11 is larger than the target vocabulary \\(10\\)"):
        build_vocab_map(np.ones(10, dtype=np.int64), 11)


def test_problems_name_what_is_wrong():
    good = build_vocab_map(np.arange(10, dtype=np.int64), 4)
    broken = VocabMap(good.d2t.copy(), good.t2d.copy())
    broken.t2d[0] = True
    assert vocab_map_problems(broken, draft_vocab_size=4, target_vocab_size=10) == [
        "nonzero(t2d) != d2t + arange(draft_vocab): the two maps disagree"
    ]
    assert vocab_map_problems(good, draft_vocab_size=5, target_vocab_size=10) == [
        "d2t is int64[4], expected int64[5]"
    ]


def vmap_problems_free(vmap: VocabMap, draft: int, target: int) -> bool:
    return vocab_map_problems(vmap, draft_vocab_size=draft, target_vocab_size=target) == []


def test_a_corrupt_token_freq_file_is_a_refusal_naming_the_file(tmp_path):
    from eagle3_assets.errors import Refusal
    from eagle3_assets.storage import ArtifactStore
    from eagle3_assets.vocab_map import TOKEN_FREQ_FILE, VocabMapError, load_token_frequencies

    store = ArtifactStore(str(tmp_path))
    store.write_bytes(TOKEN_FREQ_FILE, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(VocabMapError, match=r"token_freq/token_freq.safetensors: not a readable safetensors file .*re-materialize token_freq") as e:
        load_token_frequencies(store)
    assert isinstance(e.value, Refusal) and str(tmp_path) in str(e.value)


#                       id: 0     1  2     3     4  5     6  7     8     9
BEFORE = np.array([0, 9000, 0, 4000, 7000, 0, 2000, 0, 8000, 1000], dtype=np.int64)


def test_an_append_that_barely_moves_the_counts_keeps_the_map_a_big_change_recomputes_it():
    previous = build_vocab_map(BEFORE, 4)  # ids 1, 3, 4, 8
    # Appended rows lift id 6 just past id 3: a fresh map would swap them, moving draft ids under a trained head.
    small = BEFORE + np.array([0, 0, 0, 0, 0, 0, 2050, 0, 0, 0])
    assert np.flatnonzero(build_vocab_map(small, 4).t2d).tolist() == [1, 4, 6, 8]
    kept, how = sticky_vocab_map(previous, small, 4, 0.005)
    assert kept is previous
    assert how == (
        "kept the previous map: it covers 0.847201 of the loss tokens, a fresh map 0.848714 "
        "(within vocab_map_keep_margin 0.005)"
    )
    big = BEFORE + np.array([0, 0, 0, 0, 0, 0, 10000, 0, 0, 0])
    fresh, how = sticky_vocab_map(previous, big, 4, 0.005)
    assert np.flatnonzero(fresh.t2d).tolist() == [1, 4, 6, 8]
    assert how == (
        "recomputed: the previous map covers 0.682927 of the loss tokens, a fresh map 0.878049 "
        "(more than vocab_map_keep_margin 0.005 better)"
    )
    # A margin of 0 recomputes whenever a fresh map covers more; the first map and a resized one are computed.
    assert np.flatnonzero(sticky_vocab_map(previous, small, 4, 0.0)[0].t2d).tolist() == [1, 4, 6, 8]
    assert sticky_vocab_map(None, BEFORE, 4, 0.005)[1] == "computed: no previous map (coverage 0.903226)"
    assert sticky_vocab_map(previous, BEFORE, 3, 0.005)[1] == (
        "recomputed: the previous map is 4 of 10 ids, now 3 of 10 (coverage 0.774194)"
    )
