"""The one-launch all-reduce of rows, alone and with the residual add + RMSNorm, on one
process, a peer rank played by hand: its buffers are plain tensors and its rows already
received (Triton's interpreter on the CPU, fp32; bf16 on a GPU).
On the CPU also both ranks at once, as two processes sharing their buffers. Two GPUs run it
for real in tests/test_custom_all_reduce.py and tests/test_symm_mem.py."""

from __future__ import annotations

import multiprocessing
import queue
import threading

import pytest
import torch

from tests.kernels_support import DEVICE, DTYPE, TOLERANCE, import_kernels

all_reduce_norm = import_kernels("all_reduce_norm")
rmsnorm = import_kernels("rmsnorm")
skinny = import_kernels("skinny_linear")

EPS = 1e-6
MAX_ROWS, ROW_NUMEL = 8, 48
SLOT_NUMEL = MAX_ROWS * ROW_NUMEL


def slot(region: torch.Tensor, world: int, epoch: int, sender: int) -> torch.Tensor:
    """`sender`'s slot in a rank's region (`world` ranks) for calls of `epoch`'s parity."""
    start = ((epoch % 2) * world + sender) * SLOT_NUMEL
    return region[start:start + SLOT_NUMEL].view(MAX_ROWS, ROW_NUMEL)


def two_ranks_buffers(shared: bool = False, dtype: torch.dtype = DTYPE) -> list[torch.Tensor]:
    """Both ranks' emptied slots (`shared`: in shared memory, for forked ranks)."""
    data = [all_reduce_norm.PeerRows.empty_slots(
        torch.empty(all_reduce_norm.PeerRows.region_numel(2, ROW_NUMEL, MAX_ROWS), dtype=dtype,
                    device=DEVICE)) for _ in range(2)]
    if shared:
        for tensor in data:
            tensor.share_memory_()
    return data


class TwoRanks:
    """Rank `rank`'s view of two ranks' slots (`buffers`, new ones if None); rank `1 - rank`
    simulated, or another process's own view of the same shared buffers."""

    def __init__(self, rank: int, buffers: list[torch.Tensor] | None = None,
                 dtype: torch.dtype = DTYPE) -> None:
        self.data = buffers or two_ranks_buffers(dtype=dtype)
        self.rank, self.peer = rank, 1 - rank
        self.peers = all_reduce_norm.PeerRows(
            [d.data_ptr() for d in self.data], rank, ROW_NUMEL, MAX_ROWS, dtype,
            torch.device(DEVICE))
        if DEVICE.type == "cpu":  # the interpreter spins slowly: read the flag sooner
            self.peers.release_poll = 256

    def rows(self, receiver: int, sender: int, epoch: int, rows: int, width: int) -> torch.Tensor:
        """The rows `sender` sent `receiver` in its call `epoch`: each row has its place in
        the slot whatever the width."""
        return slot(self.data[receiver], 2, epoch, sender)[:rows, :width]

    def peer_sends(self, part: torch.Tensor, epoch: int) -> None:
        """The peer's call `epoch`: its rows in this rank's slot for it."""
        self.rows(self.rank, self.peer, epoch, *part.shape).copy_(part)

    def check_sent(self, mine: torch.Tensor, epoch: int) -> None:
        """This rank's rows went to the peer's slot for it, the peer's rows it read are
        emptied, and the rows' call counts are `epoch`."""
        rows = mine.shape[0]
        assert torch.equal(self.rows(self.peer, self.rank, epoch, *mine.shape), mine)
        assert is_empty(self.rows(self.rank, self.peer, epoch, *mine.shape)).all()
        assert self.peers.epochs[:rows].tolist() == [epoch] * rows


def is_empty(values: torch.Tensor) -> torch.Tensor:
    """Which elements are negative zeros (the kernel's empty slots)."""
    return (values == 0) & torch.signbit(values)


def call_and_expected(peers: all_reduce_norm.PeerRows,
                      parts: tuple[torch.Tensor, torch.Tensor], fused: bool,
                      draw) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's call with its part of `parts` (both ranks', in rank order), plain or
    fused (a residual and norm weight from `draw`), and what it must return."""
    total = (parts[0].float() + parts[1].float()).to(DTYPE)
    mine = parts[peers.rank]
    if not fused:
        return all_reduce_norm.all_reduce_rows(mine, peers), total
    residual, weight = draw(*mine.shape), draw(mine.shape[1])
    expected, _ = rmsnorm.add_rms_norm(total, residual.clone(), weight, EPS)
    return all_reduce_norm.all_reduce_add_rms_norm(mine, residual, weight, EPS, peers)[0], expected


def projection_parts(number: int, rows: int, width: int) -> tuple[tuple, tuple]:
    """Both ranks' inputs and weights of projected call `number` (K = 24), drawn from seeds
    either rank knows, and the parts they give (rounded as the kernel rounds its output)."""
    inputs = tuple(draws(300 * number + r)(rows, 24) for r in (0, 1))
    weights = tuple(draws(400 * number + r)(width, 24) for r in (0, 1))
    parts = tuple((x.float() @ w.float().T).to(DTYPE) for x, w in zip(inputs, weights, strict=True))
    return tuple(zip(inputs, weights, strict=True)), parts


def projected_call_and_expected(peers: all_reduce_norm.PeerRows, number: int, rows: int,
                                width: int, draw) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's projection sent from the skinny kernel's epilogue, then the reduce of the
    sent parts with the add and the norm, and what that must return."""
    operands, parts = projection_parts(number, rows, width)
    total = (parts[0].float() + parts[1].float()).to(DTYPE)
    residual, weight = draw(rows, width), draw(width)
    expected, _ = rmsnorm.add_rms_norm(total, residual.clone(), weight, EPS)
    got, _ = skinny.projection_all_reduce_add_rms_norm(*operands[peers.rank], residual, weight,
                                                      EPS, peers)
    return got, expected


def draws(seed: int, dtype: torch.dtype = DTYPE):
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(DEVICE, dtype)

    return draw


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("rows,width", [(1, 48), (3, 40), (8, 32)])
def test_matches_the_sum_then_add_rms_norm_over_calls(rank: int, rows: int, width: int) -> None:
    draw = draws(rows * width + rank)
    ranks, residual, norm_weight = TwoRanks(rank), draw(rows, width), draw(width)
    for epoch in (1, 2, 3):  # both slots, then the first again
        mine, theirs = draw(rows, width), draw(rows, width)
        ranks.peer_sends(theirs, epoch)
        parts = (mine, theirs) if rank == 0 else (theirs, mine)
        expected_out, expected_residual = rmsnorm.add_rms_norm(
            (parts[0].float() + parts[1].float()).to(DTYPE), residual.clone(), norm_weight, EPS)
        out, got_residual = all_reduce_norm.all_reduce_add_rms_norm(
            mine, residual, norm_weight, EPS, ranks.peers)
        assert got_residual is residual
        torch.testing.assert_close(residual, expected_residual, atol=TOLERANCE, rtol=TOLERANCE)
        torch.testing.assert_close(out, expected_out, atol=TOLERANCE, rtol=TOLERANCE)
        ranks.check_sent(mine, epoch)


@pytest.mark.parametrize("rank", [0, 1])
def test_rows_of_changing_counts_and_widths_sum_as_the_ranks_parts(rank: int,
                                                                  monkeypatch) -> None:
    """The plain all-reduce over calls of other row counts and widths (each row keeps its
    place and its own call count), the fused one among them. Two programs, each taking
    rows in turn, as on a GPU past its multiprocessor count: there a program's warps reach
    its next row apart, which once made a late warp read the row's count already raised and
    wait for good (session 29)."""
    monkeypatch.setattr(all_reduce_norm, "multiprocessor_count", lambda device: 2)
    draw, ranks = draws(rank), TwoRanks(rank)
    for rows, width, fused in ((2, 48, False), (5, 16, False), (2, 48, True), (1, 8, False),
                               (5, 48, False)):
        mine, theirs = draw(rows, width), draw(rows, width)
        epochs = (ranks.peers.epochs[:rows] + 1).tolist()
        for row, epoch in enumerate(epochs):  # the peer's call: each row at its own count
            ranks.rows(ranks.rank, ranks.peer, epoch, MAX_ROWS, width)[row].copy_(theirs[row])
        parts = (mine, theirs) if rank == 0 else (theirs, mine)
        got, expected = call_and_expected(ranks.peers, parts, fused, draw)
        torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=TOLERANCE)
        for row, epoch in enumerate(epochs):
            sent = ranks.rows(ranks.peer, ranks.rank, epoch, MAX_ROWS, width)[row]
            assert torch.equal(sent, mine[row])
        assert ranks.peers.epochs[:rows].tolist() == epochs


@pytest.mark.parametrize("dtype", [DTYPE, torch.float16], ids=str)
@pytest.mark.parametrize("rank", [0, 1])
def test_negative_zeros_are_sent_as_zeros_and_slots_left_empty(rank: int,
                                                                dtype: torch.dtype) -> None:
    """A part's negative zeros would read as not yet arrived at the peer: they go as
    positive ones (the sum is the same), and the slot this rank read is left empty for the
    peer's call two later. Also in fp16, whose negative zero has its own bits."""
    draw, ranks = draws(10 + rank, dtype), TwoRanks(rank, dtype=dtype)
    mine, theirs = draw(3, 16), draw(3, 16)
    mine[0, :4] = -0.0
    ranks.peer_sends(theirs, 1)
    parts = (mine, theirs) if rank == 0 else (theirs, mine)
    expected = (parts[0].float() + parts[1].float()).to(dtype)
    got = all_reduce_norm.all_reduce_rows(mine, ranks.peers)
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=TOLERANCE)
    sent = ranks.rows(ranks.peer, ranks.rank, 1, 3, 16)
    assert not is_empty(sent).any() and torch.equal(sent[0, :4], torch.zeros_like(sent[0, :4]))
    ranks.check_sent(torch.where(is_empty(mine), torch.zeros_like(mine), mine), 1)


@pytest.mark.parametrize("projected", [False, True], ids=["plain", "projected"])
@pytest.mark.parametrize("rank", [0, 2])
@pytest.mark.parametrize("world", [3, 4])
def test_several_ranks_parts_sum_in_rank_order(world: int, rank: int, projected: bool) -> None:
    """At three and four ranks (the peers played by hand, their parts already sent): the sum
    of all in rank order, this rank's part in every peer's slot for it, its own slots left
    empty, over both parities; `projected`: this rank's part sent from the projection's
    epilogue (its own slot among the others), then added to a residual and normalised."""
    rows, width = 3, 40
    regions = [all_reduce_norm.PeerRows.empty_slots(torch.empty(
        all_reduce_norm.PeerRows.region_numel(world, ROW_NUMEL, MAX_ROWS), dtype=DTYPE,
        device=DEVICE)) for _ in range(world)]
    peers = all_reduce_norm.PeerRows([r.data_ptr() for r in regions], rank, ROW_NUMEL,
                                     MAX_ROWS, DTYPE, torch.device(DEVICE))
    draw = draws(20 + rank)
    for epoch in (1, 2, 3):
        parts = [draw(rows, width) for _ in range(world)]
        x, weight = draw(rows, 24), draw(width, 24)
        if projected:
            parts[rank] = (x.float() @ weight.float().T).to(DTYPE)
        for sender in range(world):
            if sender != rank:
                slot(regions[rank], world, epoch, sender)[:rows, :width].copy_(parts[sender])
        total = parts[0].float()
        for part in parts[1:]:
            total = total + part.float()
        if projected:
            residual, norm_weight = draw(rows, width), draw(width)
            expected, _ = rmsnorm.add_rms_norm(total.to(DTYPE), residual.clone(), norm_weight,
                                               EPS)
            got, _ = skinny.projection_all_reduce_add_rms_norm(x, weight, residual,
                                                               norm_weight, EPS, peers)
        else:
            expected = total.to(DTYPE)
            got = all_reduce_norm.all_reduce_rows(parts[rank], peers)
        torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=TOLERANCE)
        for other in range(world):
            sent = slot(regions[other], world, epoch, rank)[:rows, :width]
            if other != rank and projected:  # the kernel's dot may round as torch's does not
                torch.testing.assert_close(sent, parts[rank], atol=TOLERANCE, rtol=TOLERANCE)
            elif other != rank:
                assert torch.equal(sent, parts[rank])
            assert is_empty(slot(regions[rank], world, epoch, other)[:rows, :width]).all()


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("rows,width", [(1, 48), (5, 40)])
def test_a_projection_sent_from_its_epilogue_sums_with_the_peers_part(rank: int, rows: int,
                                                                      width: int) -> None:
    """The skinny kernel sends this rank's projection into both ranks' slots for it (its
    own included) and the reduce after it takes every part from the slots, sums, adds and
    normalises, emptying them; the calls' counts go on as for the kernel's own sends."""
    ranks = TwoRanks(rank)
    for epoch in (1, 2, 3):
        operands, parts = projection_parts(epoch, rows, width)
        ranks.peer_sends(parts[ranks.peer], epoch)
        draw = draws(epoch)
        got, expected = projected_call_and_expected(ranks.peers, epoch, rows, width, draw)
        torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=TOLERANCE)
        sent = ranks.rows(ranks.peer, ranks.rank, epoch, rows, width)
        torch.testing.assert_close(sent, parts[rank], atol=TOLERANCE, rtol=TOLERANCE)
        assert is_empty(ranks.rows(ranks.rank, ranks.rank, epoch, rows, width)).all()
        assert is_empty(ranks.rows(ranks.rank, ranks.peer, epoch, rows, width)).all()
        assert ranks.peers.epochs[:rows].tolist() == [epoch] * rows


@pytest.mark.parametrize("wrong", ["norm_weight", "residual_dtype", "too_wide", "too_many_rows"])
def test_a_projection_refused_sends_nothing(wrong: str) -> None:
    """Inputs the reduce would refuse are refused before the projection sends its part: a
    part sent without its reduce would sit in the peer's slot and read as arrived in a
    later call. Nothing is sent, and the rows' call counts stay."""
    ranks, draw = TwoRanks(0), draws(5)
    rows, width = (MAX_ROWS + 1 if wrong == "too_many_rows" else 2), (
        ROW_NUMEL + 1 if wrong == "too_wide" else 16)
    x, weight = draw(rows, 24), draw(width, 24)
    residual = draw(rows, width).to(torch.float16 if wrong == "residual_dtype" else DTYPE)
    norm_weight = draw(width + (1 if wrong == "norm_weight" else 0))
    with pytest.raises(ValueError, match="takes"):
        skinny.projection_all_reduce_add_rms_norm(x, weight, residual, norm_weight, EPS,
                                                  ranks.peers)
    for region in ranks.data:
        assert is_empty(region).all()
    assert not ranks.peers.epochs.any()


RANK_SECONDS = 120  # a rank's calls take a second or two under the interpreter
# (rows, width, kind) of the two-process test: more rows than the interpreter's programs
# (each program takes several), counts and widths changing, both slots of each row used,
# calls that send their parts themselves among those sent from a projection's epilogue.
CALLS = [(1, 48, "plain"), (7, 48, "plain"), (MAX_ROWS, 48, "plain"), (MAX_ROWS, 32, "fused"),
         (3, 16, "projected"), (3, 16, "plain"), (MAX_ROWS, 48, "fused"), (5, 40, "projected"),
         (MAX_ROWS, 48, "projected"), (5, 40, "plain")]


def rank_calls(rank: int, buffers: list[torch.Tensor], results: multiprocessing.Queue) -> None:
    """One rank's CALLS over the shared buffers; each result checked against the sum of both
    ranks' parts (the peer's drawn here from its own seed)."""
    # A forked child must not enter the OpenMP pool its parent started (an engine test run
    # earlier in the process): libgomp is not fork-safe, and the child hangs in it.
    torch.set_num_threads(1)
    try:
        peers = TwoRanks(rank, buffers).peers
        for number, (rows, width, kind) in enumerate(CALLS):
            if kind == "projected":
                got, expected = projected_call_and_expected(peers, number, rows, width,
                                                            draws(number))
            else:
                parts = tuple(draws(100 * number + r)(rows, width) for r in (0, 1))
                got, expected = call_and_expected(peers, parts, kind == "fused", draws(number))
            torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=TOLERANCE,
                                       msg=f"rank {rank}, call {number}")
        results.put((rank, None))
    except BaseException as error:  # noqa: BLE001 (the parent reports it)
        results.put((rank, repr(error)))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="two processes under Triton's interpreter; "
                    "two GPUs run tests/test_custom_all_reduce.py")
def test_two_ranks_at_once_sum_alike_over_calls_of_many_rows() -> None:
    """Both ranks for real: two forked processes share their buffers (at the same addresses)
    and call the kernel at once, each waiting for the other's rows."""
    buffers = two_ranks_buffers(shared=True)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    ranks = [context.Process(target=rank_calls, args=(rank, buffers, results), daemon=True)
             for rank in (0, 1)]
    for process in ranks:
        process.start()
    finished: set[int] = set()
    try:  # a failed rank leaves its peer waiting: its error ends the test at once
        while len(finished) < len(ranks):
            rank, error = results.get(timeout=RANK_SECONDS)
            assert error is None, f"rank {rank}: {error}"
            finished.add(rank)
    except queue.Empty:
        pytest.fail(f"rank(s) {sorted({0, 1} - finished)} did not finish within "
                    f"{RANK_SECONDS} s")
    finally:
        for process in ranks:
            process.kill()
            process.join()


class Running:
    """Whether the calls launched so far were still running at some moment: on a GPU an
    event recorded after them; on the CPU they run in this thread, so a flag set after."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event() if DEVICE.type == "cuda" else None
        self.returned = False

    def launched(self) -> None:
        if self.event is not None:
            self.event.record()
        else:
            self.returned = True

    def still(self) -> bool:
        return not self.event.query() if self.event is not None else not self.returned


def finish() -> None:
    """Wait for this device's kernels (on a GPU without holding the GIL, so a timer's thread
    can act meanwhile)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def later(action, seen: list, running: Running) -> threading.Timer:
    """In 0.5 s: note whether the calls were still running, then `action()`."""
    timer = threading.Timer(0.5, lambda: (seen.append(running.still()), action()))
    timer.start()
    return timer


def test_released_waits_end_without_the_peer_for_good() -> None:
    """A peer that never sends again (it died): the host releases this rank's waits from
    another thread while the kernel waits, the call returns, and later calls at once."""
    draw, ranks = draws(7), TwoRanks(0)
    mine = draw(3, 16)
    ranks.peer_sends(draw(3, 16), 1)
    all_reduce_norm.all_reduce_rows(mine, ranks.peers)  # call 1, the peer's last; compiled
    finish()
    running, seen = Running(), []
    timer = later(ranks.peers.release_waits, seen, running)
    all_reduce_norm.all_reduce_rows(mine, ranks.peers)  # call 2 waits for the release
    running.launched()
    all_reduce_norm.all_reduce_rows(mine, ranks.peers)  # call 3 does not wait
    finish()
    timer.join()
    assert seen == [True], "call 2 ended before the release: it did not wait"
    assert ranks.peers.released.item() == 1 and ranks.peers.release_seen.item() == 1


def test_later_waits_end_on_the_devices_note_of_the_release() -> None:
    """Once a wait saw the host's release, later calls end from the device's note alone,
    without waiting for their next read of the host flag (here cleared again: were they to
    read it, they would wait until the safety release below)."""
    draw, ranks = draws(8), TwoRanks(0)
    mine = draw(3, 16)
    ranks.peers.release_waits()
    all_reduce_norm.all_reduce_rows(mine, ranks.peers)  # waits up to one read of the flag
    finish()
    ranks.peers.released.fill_(0)
    running, seen = Running(), []
    timer = later(ranks.peers.release_waits, seen, running)
    all_reduce_norm.all_reduce_rows(mine, ranks.peers)
    all_reduce_norm.all_reduce_add_rms_norm(mine, mine.clone(), torch.ones(16, dtype=DTYPE,
                                            device=DEVICE), EPS, ranks.peers)
    running.launched()
    finish()
    timer.join()
    assert seen == [False], "a later call waited for the host flag: the device's note failed"


def test_refuses_what_does_not_fit() -> None:
    ranks = TwoRanks(0)
    too_many_rows = torch.zeros(MAX_ROWS + 1, 4, dtype=DTYPE, device=DEVICE)
    too_wide = torch.zeros(2, ROW_NUMEL + 1, dtype=DTYPE, device=DEVICE)
    strided = torch.zeros(4, 8, dtype=DTYPE, device=DEVICE).t()
    for x in (too_many_rows, too_wide, strided):
        assert not ranks.peers.takes(x)
        with pytest.raises(ValueError, match="rows at most"):
            all_reduce_norm.all_reduce_add_rms_norm(x, x.clone(), torch.ones(x.shape[1]),
                                                    EPS, ranks.peers)
        with pytest.raises(ValueError, match="rows at most"):
            all_reduce_norm.all_reduce_rows(x, ranks.peers)
