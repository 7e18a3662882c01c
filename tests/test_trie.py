"""producer.tokenization's tries against genlm-backend 0.3.1's: same nodes, edges and weights.

genlm-control walks ``root``/``children``/``word2leaf`` of whatever trie it gets, so the layout
must match node for node, not just the weights. Weights are compared at rtol 1e-5.
"""

from __future__ import annotations

import ast
import asyncio
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from genlm.backend.tokenization import Token as GenlmToken
from genlm.backend.trie import AsyncTokenCharacterTrie as GenlmAsyncTrie
from genlm.backend.trie import ParallelTokenCharacterTrie as GenlmParallelTrie
from genlm.backend.trie import TokenCharacterTrie as GenlmTrie
from hypothesis import given, settings
from hypothesis import strategies as st

import producer.tokenization
from producer.tokenization.trie import TokenCharacterTrie, is_leaf_edge
from producer.tokenization.trie_async import AsyncTokenCharacterTrie
from producer.tokenization.trie_parallel import ParallelTokenCharacterTrie
from producer.tokenization.vocab import Token

RTOL, ATOL = 1e-5, 1e-8
TOY_BYTES = [b"a", b"b", b"ab", b"<eos>"]
TOY_WEIGHTS = [0.1, 0.2, 0.2, 0.5]

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


def tokens(words: list[bytes]) -> list[Token]:
    return [Token(i, w) for i, w in enumerate(words)]


def genlm_tokens(words: list[bytes]) -> list[GenlmToken]:
    return [GenlmToken(i, w) for i, w in enumerate(words)]


def random_vocab(n: int, seed: int) -> list[bytes]:
    """Words over a small alphabet, so prefixes are shared deeply, with some duplicates."""
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"ab \xc3\xa9\x00\xff", dtype=np.uint8)
    words = [bytes(rng.choice(alphabet, size=rng.integers(1, 9)).tolist()) for _ in range(n)]
    return words + words[: n // 10]


def random_weights(rng: np.random.Generator, batch: int, n: int) -> torch.Tensor:
    return torch.softmax(torch.tensor(rng.normal(size=(batch, n)) * 3, dtype=torch.float32), -1)


def assert_same_layout(ours: TokenCharacterTrie, theirs: Any) -> None:
    """Node ids, edges and lookups exactly as genlm-backend lays them out."""
    assert ours.root == theirs.root == len(ours.children) - 1
    assert ours.children == theirs.children
    assert [list(c) for c in ours.children] == [list(c) for c in theirs.children]  # key order
    assert ours.word2leaf == theirs.word2leaf
    assert ours.leaf2word == theirs.leaf2word
    assert ours.idx_to_leaf.dtype == theirs.idx_to_leaf.dtype == np.int32
    np.testing.assert_array_equal(ours.idx_to_leaf, theirs.idx_to_leaf)
    np.testing.assert_array_equal(ours.ordering, theirs.ordering)
    assert len(ours.jump) == len(theirs.jump)
    for mine, their in zip(ours.jump, theirs.jump, strict=True):
        np.testing.assert_array_equal(mine, their)
    assert ours.node2prefix == theirs.node2prefix
    assert list(ours._order(ours.root)) == list(theirs._order(theirs.root))
    assert list(ours._order_full(ours.root)) == list(theirs._order_full(theirs.root))


def node_of(trie: TokenCharacterTrie, word: bytes) -> int:
    node = trie.root
    for byte in word:
        node = trie.children[node][byte]
    return node


def assert_close(have: Any, want: Any) -> None:
    np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=RTOL, atol=ATOL)


# -- layout -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "words",
    [
        TOY_BYTES,
        [b"a", b"hello", b"hello", b"world", b"", b"hel"],
        random_vocab(300, seed=1),
    ],
    ids=["toy", "duplicates", "random"],
)
def test_layout_matches_genlm(words: list[bytes]) -> None:
    ours = TokenCharacterTrie(tokens(words))
    assert_same_layout(ours, GenlmTrie(genlm_tokens(words)))
    assert_same_layout(ParallelTokenCharacterTrie(tokens(words), device="cpu"), ours)


def test_layout_of_plain_bytes_and_other_iterables_matches_genlm() -> None:
    with pytest.warns(DeprecationWarning, match="plain bytes"):
        ours = TokenCharacterTrie(TOY_BYTES)
    with pytest.warns(DeprecationWarning):
        theirs = GenlmTrie(TOY_BYTES)
    assert_same_layout(ours, theirs)
    assert ours.word2leaf.keys() == set(TOY_BYTES)
    words = ["a", "ab", "b", ("x", "y")]  # non-bytes items iterate as they are
    assert_same_layout(TokenCharacterTrie(words), GenlmTrie(words))


def test_plain_bytes_warning_points_at_the_caller() -> None:
    with pytest.warns(DeprecationWarning) as record:
        ParallelTokenCharacterTrie(TOY_BYTES, device="cpu")
    assert [w.filename for w in record] == [__file__]


def test_duplicate_keys_are_rejected() -> None:
    with pytest.raises(ValueError, match="Duplicate word"), pytest.warns(DeprecationWarning):
        TokenCharacterTrie([b"a", b"a"])
    with pytest.raises(ValueError, match="Duplicate word"):
        TokenCharacterTrie([Token(0, b"a"), Token(0, b"a")])


def test_duplicate_bytes_get_their_own_leaves() -> None:
    vocab = tokens([b"a", b"hello", b"hello", b"world"])
    trie = TokenCharacterTrie(vocab)
    (_, leaf1), (_, leaf2) = trie.idx_to_leaf[1], trie.idx_to_leaf[2]
    assert leaf1 != leaf2 and {leaf1, leaf2} <= trie.leaf2word.keys()
    assert trie.word2leaf[(b"hello", 1)] == leaf1 and trie.word2leaf[(b"hello", 2)] == leaf2
    ws = trie.weight_sum([0.1, 0.2, 0.3, 0.4])
    assert ws[leaf1] == pytest.approx(0.2) and ws[leaf2] == pytest.approx(0.3)
    assert ws[node_of(trie, b"hello")] == pytest.approx(0.5)
    assert ws[node_of(trie, b"hel")] == pytest.approx(0.5)


def test_walk_as_genlm_control_does() -> None:
    """Spell each token from the root, then take its leaf edge ``(None, index)``."""
    vocab = tokens(random_vocab(200, seed=2))
    trie = ParallelTokenCharacterTrie(vocab, device="cpu")
    for token in vocab:
        node = trie.root
        for byte in token:
            node = trie.children[node][byte]
        leaf = trie.children[node][(None, token.token_id)]
        assert is_leaf_edge((None, token.token_id)) and not is_leaf_edge(byte)
        assert trie.word2leaf[(bytes(token), token.token_id)] == leaf
        assert trie.leaf2word[leaf] == (bytes(token), token.token_id)
        assert trie.leaf2token_id[leaf] == token.token_id
        assert trie.node2prefix[leaf] == list(token)
    assert trie.token_id_to_leaf is trie.idx_to_leaf


def test_genlm_tokens_are_tokens_too() -> None:
    """genlm-backend's Token objects are keyed like ours, without a deprecation warning."""
    trie = TokenCharacterTrie(genlm_tokens(TOY_BYTES))
    assert set(trie.word2leaf) == {(w, i) for i, w in enumerate(TOY_BYTES)}


def test_very_long_token_does_not_recurse() -> None:
    long = b"x" * (sys.getrecursionlimit() + 500)
    trie = TokenCharacterTrie(tokens([long, b"x", b"y"]))
    ws = trie.weight_sum([0.5, 0.25, 0.125])
    assert ws[trie.root] == pytest.approx(0.875)
    assert ws[trie.children[trie.root][ord("x")]] == pytest.approx(0.75)
    assert trie.weight_max([0.5, 0.25, 0.125])[trie.root] == pytest.approx(0.5)


# -- weights ------------------------------------------------------------------------------------

TOY_SUMS = {b"": 1.0, b"a": 0.3, b"b": 0.2, b"ab": 0.2, b"<": 0.5, b"<eos>": 0.5}
TOY_MAXES = {b"": 0.5, b"a": 0.2, b"b": 0.2, b"ab": 0.2, b"<": 0.5, b"<eos>": 0.5}


@pytest.mark.parametrize("kind", ["sequential", "parallel"])
@pytest.mark.parametrize("op, wants", [("weight_sum", TOY_SUMS), ("weight_max", TOY_MAXES)])
def test_toy_weights(kind: str, op: str, wants: dict[bytes, float]) -> None:
    """genlm-backend's own toy expectations, node by node."""
    trie = make_trie(kind, tokens(TOY_BYTES))
    have = getattr(trie, op)(torch.tensor(TOY_WEIGHTS))
    assert have.shape == (len(trie.children),)
    leaf_ws = dict(zip(TOY_BYTES, TOY_WEIGHTS, strict=True))
    for node, prefix in trie.node2prefix.items():
        if node in trie.leaf2word:
            assert have[node] == pytest.approx(leaf_ws[bytes(prefix)])
        elif bytes(prefix) in wants:
            assert have[node] == pytest.approx(wants[bytes(prefix)])
        else:  # inner nodes of "<eos>"
            assert have[node] == pytest.approx(0.5)


def make_trie(kind: str, vocab: Any, device: str = "cpu") -> TokenCharacterTrie:
    if kind == "sequential":
        return TokenCharacterTrie(vocab)
    return ParallelTokenCharacterTrie(vocab, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_weights_match_genlm(device: str) -> None:
    words = random_vocab(400, seed=3)
    vocab, their_vocab = tokens(words), genlm_tokens(words)
    rng = np.random.default_rng(0)
    batch = random_weights(rng, 3, len(words)).to(device)
    seq, par = TokenCharacterTrie(vocab), ParallelTokenCharacterTrie(vocab, device=device)
    their_seq = GenlmTrie(their_vocab)
    their_par = GenlmParallelTrie(their_vocab, device=device)
    for op in ("weight_sum", "weight_max"):
        want = getattr(their_seq, "batch_" + op)(batch)
        assert_close(getattr(seq, "batch_" + op)(batch), want)
        assert_close(getattr(par, "batch_" + op)(batch), getattr(their_par, "batch_" + op)(batch))
        assert_close(getattr(par, "batch_" + op)(list(batch)), want)
        for row, w in zip(batch, want, strict=True):
            assert_close(getattr(seq, op)(row), w)
            assert_close(getattr(par, op)(row), w)
            assert_close(getattr(seq, op)(row.cpu().numpy()), w)
            assert_close(getattr(par, op)(row.tolist()), w)


def test_result_types_match_genlm() -> None:
    seq, par = TokenCharacterTrie(tokens(TOY_BYTES)), ParallelTokenCharacterTrie(tokens(TOY_BYTES))
    ws = torch.tensor(TOY_WEIGHTS)
    assert seq.weight_sum(ws).dtype == np.float64 and par.weight_sum(ws).dtype == np.float32
    assert seq.batch_weight_max([ws, ws]).shape == (2, len(seq.children))
    assert par.batch_weight_max(torch.stack([ws, ws])).shape == (2, len(seq.children))
    assert isinstance(par.M, torch.Tensor) and par.M.layout == torch.sparse_csr
    assert par.M.shape == (len(TOY_BYTES), len(par.children))


@pytest.mark.parametrize("kind", ["sequential", "parallel"])
def test_bfloat16_and_grad_weights_are_accepted(kind: str) -> None:
    """Logits straight from a model: bfloat16 (no numpy dtype) or still attached to a graph."""
    trie = make_trie(kind, tokens(TOY_BYTES))
    ws = torch.tensor(TOY_WEIGHTS)
    half = ws.to(torch.bfloat16)
    assert_close(trie.weight_sum(half), trie.weight_sum(half.float()))
    assert_close(trie.batch_weight_max(half[None]), [trie.weight_max(half.float())])
    assert_close(trie.weight_sum(ws.clone().requires_grad_()), trie.weight_sum(ws))
    assert trie.weight_sum(half)[trie.root] == pytest.approx(1.0, rel=1e-2)


def test_log_weight_max_is_the_true_max() -> None:
    """With log-weights (all negative) the max of an inner node is its best token's.

    genlm-backend's parallel trie agrees; its sequential one floors inner nodes at 0.
    """
    words = random_vocab(200, seed=4)
    logws = torch.log(random_weights(np.random.default_rng(1), 1, len(words))[0])
    seq = TokenCharacterTrie(tokens(words))
    want = GenlmParallelTrie(genlm_tokens(words), device="cpu").weight_max(logws)
    assert_close(seq.weight_max(logws), want)
    assert_close(ParallelTokenCharacterTrie(tokens(words), device="cpu").weight_max(logws), want)
    assert seq.weight_max(logws)[seq.root] == pytest.approx(float(logws.max()))
    assert GenlmTrie(genlm_tokens(words)).weight_max(logws)[seq.root] == 0.0  # the floor


@settings(max_examples=40, deadline=None, database=None)
@given(
    words=st.lists(st.binary(min_size=0, max_size=5), min_size=1, max_size=25),
    seed=st.integers(0, 2**16),
)
def test_random_vocabularies_match_genlm(words: list[bytes], seed: int) -> None:
    ws = np.random.default_rng(seed).random(len(words))
    ours, theirs = TokenCharacterTrie(tokens(words)), GenlmTrie(genlm_tokens(words))
    assert_same_layout(ours, theirs)
    assert_close(ours.weight_sum(ws), theirs.weight_sum(ws))
    assert_close(ours.weight_max(ws), theirs.weight_max(ws))
    par = ParallelTokenCharacterTrie(tokens(words), device="cpu")
    assert_close(par.weight_sum(ws), theirs.weight_sum(ws))
    assert_close(par.weight_max(ws), theirs.weight_max(ws))


# -- invalid input ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sequential", "parallel"])
def test_wrong_weight_length_is_a_clear_error(kind: str) -> None:
    trie = make_trie(kind, tokens(TOY_BYTES))
    for op in ("weight_sum", "weight_max"):
        with pytest.raises(ValueError, match=r"Expected 4 token weights .* got 3"):
            getattr(trie, op)(torch.tensor([0.1, 0.2, 0.3]))
        with pytest.raises(ValueError, match=r"Expected 4 token weights .* got 5"):
            getattr(trie, "batch_" + op)([np.ones(4), np.ones(5)])
        with pytest.raises(ValueError, match=r"Expected 4 token weights .* got 2"):
            getattr(trie, "batch_" + op)(np.ones((3, 2)))
        with pytest.raises(ValueError, match="1-D"):
            getattr(trie, op)(np.ones((2, 4)))


def test_parallel_device_is_checked() -> None:
    with pytest.raises(ValueError, match="Invalid device"):
        ParallelTokenCharacterTrie(tokens(TOY_BYTES), device="invalid")
    trie = ParallelTokenCharacterTrie(tokens(TOY_BYTES), device=torch.device("cpu"))
    assert trie.device == "cpu" and trie.M.device.type == "cpu"
    default = ParallelTokenCharacterTrie(tokens(TOY_BYTES))
    assert default.device == ("cuda" if torch.cuda.is_available() else "cpu")


# -- async --------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["sequential", "parallel"])
async def test_async_batches_concurrent_requests(backend: str) -> None:
    words = random_vocab(300, seed=5)
    batch = random_weights(np.random.default_rng(2), 5, len(words))
    ours = AsyncTokenCharacterTrie.from_vocab(tokens(words), backend=backend)
    theirs = GenlmAsyncTrie.from_vocab(genlm_tokens(words), backend=backend)
    sizes: list[int] = []
    compute = ours.trie.batch_weight_sum

    def spy(ws: Any) -> Any:
        sizes.append(len(ws))
        return compute(ws)

    ours.trie.batch_weight_sum = spy  # type: ignore[method-assign]
    try:
        sums = await asyncio.gather(*[ours.weight_sum(w) for w in batch])
        maxes = await asyncio.gather(*[ours.weight_max(w) for w in batch])
        want_sums = await asyncio.gather(*[theirs.weight_sum(w) for w in batch])
        want_maxes = await asyncio.gather(*[theirs.weight_max(w) for w in batch])
    finally:
        await ours.cleanup()
        await theirs.cleanup()
    assert sizes == [5]  # one batched call answered all five
    assert isinstance(ours.trie, make_trie(backend, tokens(TOY_BYTES)).__class__)
    for have, want, direct in zip(sums, want_sums, ours.trie.batch_weight_sum(batch), strict=True):
        assert_close(have, want)
        np.testing.assert_array_equal(have, direct)
    for have, want in zip(maxes, want_maxes, strict=True):
        assert_close(have, want)


@pytest.mark.asyncio
async def test_async_mixed_operations_in_one_round() -> None:
    trie = AsyncTokenCharacterTrie.from_vocab(tokens(TOY_BYTES), backend="sequential")
    ws = torch.tensor(TOY_WEIGHTS)
    total, best = await asyncio.gather(trie.weight_sum(ws), trie.weight_max(ws))
    await trie.cleanup()
    assert total[trie.trie.root] == pytest.approx(1.0)
    assert best[trie.trie.root] == pytest.approx(0.5)


@pytest.mark.asyncio
async def test_async_bad_request_fails_alone() -> None:
    trie = AsyncTokenCharacterTrie.from_vocab(tokens(TOY_BYTES), backend="parallel", device="cpu")
    good, bad = torch.tensor(TOY_WEIGHTS), torch.tensor([0.5, 0.5])
    results = await asyncio.gather(
        trie.weight_sum(good), trie.weight_sum(bad), trie.weight_max(good), return_exceptions=True
    )
    total, error, best = results
    assert isinstance(error, ValueError) and "Expected 4 token weights" in str(error)
    assert isinstance(total, np.ndarray) and total[trie.trie.root] == pytest.approx(1.0)
    assert isinstance(best, np.ndarray) and best[trie.trie.root] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="Unknown operation"):
        await (await trie._queue_request(good, "invalid-op"))
    assert (await trie.weight_sum(good))[trie.trie.root] == pytest.approx(1.0)  # still serving
    await trie.cleanup()


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["sequential", "parallel"])
async def test_async_wraps_genlm_backends_trie(backend: str) -> None:
    """Like genlm-backend's wrapper, ours batches for any trie with ``batch_weight_sum`` /
    ``batch_weight_max`` (genlm-backend's own, a subclass...), not only for lmpool's."""
    vocab = genlm_tokens(TOY_BYTES)
    inner = GenlmTrie(vocab) if backend == "sequential" else GenlmParallelTrie(vocab, device="cpu")
    trie = AsyncTokenCharacterTrie(inner)
    try:
        total, best = await asyncio.gather(
            trie.weight_sum(torch.tensor(TOY_WEIGHTS)), trie.weight_max(np.array(TOY_WEIGHTS))
        )
        with pytest.raises(ValueError, match=r"Expected 4 token weights .* got 2"):
            await trie.weight_sum(np.array([0.5, 0.5]))
    finally:
        await trie.cleanup()
    assert_close(total, inner.weight_sum(np.array(TOY_WEIGHTS)))
    assert_close(best, inner.weight_max(np.array(TOY_WEIGHTS)))


@pytest.mark.asyncio
async def test_async_start_cleanup_shutdown() -> None:
    trie = AsyncTokenCharacterTrie.from_vocab(tokens(TOY_BYTES), backend="sequential")
    trie.start()
    task = trie._task
    assert task is not None and not task.done()
    trie.start()
    assert trie._task is task  # idempotent
    await trie.cleanup()
    assert trie._task is None and task.cancelled()
    assert (await trie.weight_sum(TOY_WEIGHTS))[trie.trie.root] == pytest.approx(1.0)
    task = trie._task
    assert task is not None
    trie.shutdown()
    assert trie._task is None
    await asyncio.sleep(0)
    assert task.cancelled()


def test_async_restarts_on_a_new_event_loop() -> None:
    """A trie kept across ``asyncio.run`` calls must not wait on its dead first loop."""
    trie = AsyncTokenCharacterTrie.from_vocab(tokens(TOY_BYTES), backend="sequential")
    for _ in range(2):
        result = asyncio.run(asyncio.wait_for(trie.weight_sum(TOY_WEIGHTS), timeout=5))
        assert result[trie.trie.root] == pytest.approx(1.0)
    trie.shutdown()


def test_async_invalid_backend() -> None:
    with pytest.raises(ValueError, match="Unknown backend"):
        AsyncTokenCharacterTrie.from_vocab(tokens(TOY_BYTES), backend="invalid")


# -- misc ---------------------------------------------------------------------------------------


def test_classes_importable_from_the_package() -> None:
    import producer

    for name in ("TokenCharacterTrie", "ParallelTokenCharacterTrie", "AsyncTokenCharacterTrie"):
        assert getattr(producer.tokenization, name) is getattr(producer, name)
    assert producer.tokenization.ParallelTokenCharacterTrie is ParallelTokenCharacterTrie
    assert producer.tokenization.AsyncTokenCharacterTrie is AsyncTokenCharacterTrie
    assert producer.tokenization.Token is producer.Token is Token


def test_trie_modules_import_downward_only() -> None:
    """trie <- trie_parallel <- trie_async and token, bytes <- vocab: no module imports one
    that imports it."""
    folder = Path(producer.tokenization.__file__).parent
    imported = {}
    for name in ("trie", "trie_parallel", "trie_async", "token", "bytes", "vocab"):
        tree = ast.parse((folder / f"{name}.py").read_text())
        imported[name] = {
            node.module.rsplit(".", 1)[-1]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("producer.tokenization")
        }
    assert imported == {
        "trie": set(),
        "trie_parallel": {"trie"},
        "trie_async": {"trie", "trie_parallel"},
        "token": set(),
        "bytes": set(),
        "vocab": {"token", "bytes"},
    }


def test_visualize_matches_genlm() -> None:
    pytest.importorskip("graphviz")
    ours, theirs = TokenCharacterTrie(tokens(TOY_BYTES)), GenlmTrie(genlm_tokens(TOY_BYTES))
    assert ours.visualize().source == theirs.visualize().source
    ws = ours.weight_sum(TOY_WEIGHTS)
    assert ours.visualize(ws).source == theirs.visualize(ws).source
    assert "End-of-Token (ID: 2)" in ours.visualize(ws).source
    zeros = torch.zeros(len(ours.children))
    assert ours.visualize(zeros).source == theirs.visualize(zeros).source
    with pytest.raises(ValueError, match="must match number of nodes"):
        ours.visualize(torch.ones(len(ours.children) + 1))
