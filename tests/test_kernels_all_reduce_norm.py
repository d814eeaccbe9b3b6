"""The one-launch all-reduce + residual add + RMSNorm on one process, a peer rank played by
hand: its buffers are plain tensors, its row already received and its signal already sent
(Triton's interpreter on the CPU, fp32; bf16 on a GPU). Two GPUs run it for real in
tests/test_symm_mem.py."""

from __future__ import annotations

import pytest
import torch

from tests.kernels_support import DEVICE, DTYPE, TOLERANCE, import_kernels

all_reduce_norm = import_kernels("all_reduce_norm")
rmsnorm = import_kernels("rmsnorm")

EPS = 1e-6
MAX_ROWS, SLOT_NUMEL = 8, 8 * 48


class TwoRanks:
    """Rank `rank`'s view of two ranks' slots and signals, rank `1 - rank` simulated."""

    def __init__(self, rank: int) -> None:
        self.data = [torch.zeros(2 * 2 * SLOT_NUMEL, dtype=DTYPE, device=DEVICE)
                     for _ in range(2)]
        self.flags = [torch.zeros(MAX_ROWS * 2, dtype=torch.int32, device=DEVICE)
                      for _ in range(2)]
        self.rank, self.peer = rank, 1 - rank
        self.peers = all_reduce_norm.PeerRows(
            [d.data_ptr() for d in self.data], [f.data_ptr() for f in self.flags], rank,
            SLOT_NUMEL, MAX_ROWS, DTYPE, torch.device(DEVICE))

    def slot(self, receiver: int, sender: int, epoch: int, numel: int) -> torch.Tensor:
        start = ((epoch % 2) * 2 + sender) * SLOT_NUMEL
        return self.data[receiver][start:start + numel]

    def peer_sends(self, part: torch.Tensor, epoch: int) -> None:
        """The peer's call `epoch`: its rows in this rank's slot for it, its signal in this
        rank's flags."""
        self.slot(self.rank, self.peer, epoch, part.numel()).copy_(part.reshape(-1))
        self.flags[self.rank].view(MAX_ROWS, 2)[: part.shape[0], self.peer] = epoch


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("rows,width", [(1, 48), (3, 40), (8, 32)])
def test_matches_the_sum_then_add_rms_norm_over_calls(rank: int, rows: int, width: int) -> None:
    generator = torch.Generator().manual_seed(rows * width + rank)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(DEVICE, DTYPE)

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
        # This rank's rows went to the peer's slot for it, and its signal too.
        assert torch.equal(ranks.slot(ranks.peer, rank, epoch, mine.numel()), mine.reshape(-1))
        assert ranks.flags[ranks.peer].view(MAX_ROWS, 2)[:rows, rank].tolist() == [epoch] * rows
        assert ranks.peers.epochs[:rows].tolist() == [epoch] * rows


def test_refuses_what_does_not_fit() -> None:
    ranks = TwoRanks(0)
    too_many_rows = torch.zeros(MAX_ROWS + 1, 4, dtype=DTYPE, device=DEVICE)
    too_wide = torch.zeros(2, SLOT_NUMEL, dtype=DTYPE, device=DEVICE)
    for x in (too_many_rows, too_wide):
        assert not ranks.peers.takes(x)
        with pytest.raises(ValueError, match="rows at most"):
            all_reduce_norm.all_reduce_add_rms_norm(x, x.clone(), torch.ones(x.shape[1]),
                                                    EPS, ranks.peers)
