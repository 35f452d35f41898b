"""Low rank: PowerSGD in two rounds and in one, in one process (several ranks driven by hand)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from compressor_cases import drive
from thinwire.compress import Slot, run_locally
from thinwire.compress.feedback import ResidualMemory
from thinwire.compress.powersgd import PowerSGD, orthogonalize_rows
from thinwire.compress.powersgd_oneround import Bases, OneRoundPowerSGD

# -- PowerSGD -----------------------------------------------------------------------------


def test_powersgd_at_full_rank_reconstructs_the_matrix() -> None:
    x = torch.randn(12, 9, generator=torch.Generator().manual_seed(0))
    comp = PowerSGD(rank=9, min_compression=0)
    wire: list[int] = []
    out = run_locally(comp.exchange(x, Slot("w", 0, 1)), wire)
    torch.testing.assert_close(out.mean, x, rtol=0, atol=1e-4)
    assert out.local is not None
    torch.testing.assert_close(out.local, x, rtol=0, atol=1e-4)
    assert wire == [9 * 12 * 4, 9 * 9 * 4]  # P^T then Q^T
    # conv-shaped tensors are matrices of shape[0] rows
    conv = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(1))
    out = run_locally(PowerSGD(rank=4, min_compression=0).exchange(conv, Slot("c", 0, 1)))
    assert out.mean.shape == conv.shape
    torch.testing.assert_close(out.mean, conv, rtol=0, atol=1e-4)


def matrix_with_known_rank2_error() -> tuple[Tensor, float]:
    """A 60 x 40 matrix of singular values 10, 9, 7, 6, 5, then 0.01, and the error of its
    best rank-2 approximation (Eckart-Young)."""
    gen = torch.Generator().manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(60, 60, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(40, 40, generator=gen))
    spectrum = torch.tensor([10.0, 9.0, 7.0, 6.0, 5.0] + [0.01] * 35)
    return u[:, :40] @ torch.diag(spectrum) @ v.T, float(spectrum[2:].norm())


def test_powersgd_warm_start_converges_to_the_best_rank_r_error() -> None:
    m, best = matrix_with_known_rank2_error()
    comp = PowerSGD(rank=2)
    errors = []
    for step in range(15):
        out = run_locally(comp.exchange(m, Slot("w", step, 1)))
        errors.append(float((m - out.mean).norm()))
    assert errors[0] > 1.15 * best  # a random start is far from the best subspace ...
    assert errors[-1] < 1.001 * best  # ... power iteration with warm start finds it
    assert all(later <= earlier + 1e-3 for earlier, later in itertools.pairwise(errors))
    # without the warm start (a fresh Q every step) it would stay where it started
    cold = [
        float((m - run_locally(PowerSGD(rank=2).exchange(m, Slot("w", s, 1))).mean).norm())
        for s in range(3)
    ]
    assert cold == pytest.approx([errors[0]] * 3, rel=1e-4)


def test_powersgd_error_feedback_sends_everything_eventually() -> None:
    gen = torch.Generator().manual_seed(2)
    m = torch.randn(10, 8, generator=gen)  # full rank: rank 1 alone is far off
    comp, memory = PowerSGD(rank=1), ResidualMemory()
    sent = torch.zeros(10, 8)
    gaps, residuals = [], []
    for step in range(1, 81):
        slot = Slot("w", step, 1)
        corrected = memory.compensate(m, slot)
        result = run_locally(comp.exchange(corrected, slot))
        memory.update(corrected, result, slot, compressed=True)
        sent += result.mean
        gaps.append(float((sent / step - m).norm() / m.norm()))
        residuals.append(float(memory.residuals["w"].norm() / m.norm()))
    # the average sent approaches M because the residual stays bounded
    assert gaps[0] > 0.5
    assert gaps[-1] < 0.1
    assert gaps[-1] < gaps[9] / 3
    assert max(residuals[40:]) < 2 * max(residuals[:40])


def test_powersgd_state_dict_round_trip_gives_identical_next_output() -> None:
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(20, 30, generator=gen) for _ in range(4)]
    first = PowerSGD(rank=2)
    for step in range(3):
        run_locally(first.exchange(grads[step], Slot("w", step, 1)))
    second = PowerSGD(rank=2, seed=123)
    second.load_state_dict(first.state_dict())
    a = run_locally(first.exchange(grads[3], Slot("w", 3, 1))).mean
    b = run_locally(second.exchange(grads[3], Slot("w", 3, 1))).mean
    assert torch.equal(a, b)
    fresh = run_locally(PowerSGD(rank=2, seed=123).exchange(grads[3], Slot("w", 3, 1))).mean
    assert not torch.equal(a, fresh)  # the warm start really is state
    with pytest.raises(ValueError, match="unknown state"):
        second.load_state_dict({"q": {}})


def test_powersgd_two_ranks_average_like_one_rank_at_full_rank() -> None:
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)
    ranks = [PowerSGD(rank=6, min_compression=0), PowerSGD(rank=6, min_compression=0)]
    results = drive(
        [c.exchange(x, Slot("w", 0, 2, r)) for r, (c, x) in enumerate(zip(ranks, (a, b)))]
    )
    single = run_locally(PowerSGD(rank=6, min_compression=0).exchange((a + b) / 2, Slot("w", 0, 1)))
    for rank, own in enumerate((a, b)):
        torch.testing.assert_close(results[rank].mean, (a + b) / 2, rtol=0, atol=1e-4)
        torch.testing.assert_close(results[rank].mean, single.mean, rtol=0, atol=1e-4)
        torch.testing.assert_close(results[rank].local, own, rtol=0, atol=1e-4)
    # every rank keeps the same warm start
    assert torch.equal(ranks[0].warm["w"], ranks[1].warm["w"])


def test_powersgd_two_ranks_at_low_rank_agree_and_match_the_formula() -> None:
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(30, 20, generator=gen), torch.randn(30, 20, generator=gen)
    ranks = [PowerSGD(rank=2), PowerSGD(rank=2)]
    qt = ranks[0]._warm_start("w", a)
    results = drive(
        [c.exchange(x, Slot("w", 0, 2, r)) for r, (c, x) in enumerate(zip(ranks, (a, b)))]
    )
    pt = orthogonalize_rows(qt @ a.T + qt @ b.T)
    expected = pt.T @ (pt @ a + pt @ b) / 2
    for rank, own in enumerate((a, b)):
        torch.testing.assert_close(results[rank].mean, expected)
        torch.testing.assert_close(results[rank].local, pt.T @ (pt @ own))


def test_powersgd_restarts_after_an_all_zero_gradient() -> None:
    comp = PowerSGD(rank=2)
    run_locally(comp.exchange(torch.zeros(20, 30), Slot("w", 0, 1)))
    assert float(comp.warm["w"].abs().sum()) > 0  # Q refilled, not stuck at zero
    low_rank = torch.outer(torch.arange(20.0), torch.ones(30))
    out = run_locally(comp.exchange(low_rank, Slot("w", 1, 1)))
    torch.testing.assert_close(out.mean, low_rank, rtol=0, atol=1e-3)


# -- PowerSGD in one round ----------------------------------------------------------------


def one_round_projection(
    bases: Bases, alternate_side: bool | None = None
) -> Callable[[Tensor], Tensor]:
    """Pi(M) = C^T C M + M R^T R - C^T C M R^T R for ``bases`` (C, R); with
    ``alternate_side`` True or False only the C or only the R term."""
    c, r = bases.columns, bases.rows
    pc, pr = c.T @ c, r.T @ r
    if alternate_side is None:
        return lambda x: pc @ x + x @ pr - pc @ x @ pr
    return (lambda x: pc @ x) if alternate_side else (lambda x: x @ pr)


@pytest.mark.parametrize("alternate", [False, True], ids=["both-sides", "alternate"])
def test_one_round_powersgd_sends_one_sum_per_exchange(alternate: bool) -> None:
    comp = OneRoundPowerSGD(rank=2, alternate=alternate)
    x = torch.randn(12, 30, generator=torch.Generator().manual_seed(6))
    sizes = []
    for step in range(4):
        wire: list[int] = []
        run_locally(comp.exchange(x, Slot("w", step, 1)), wire)
        assert len(wire) == 1  # one sum per exchange
        sizes.append(wire[0])
    c_side, r_side = 2 * 30 * 4, 2 * 12 * 4  # X = C M, Y = R M^T
    if not alternate:
        assert sizes == [c_side + r_side] * 4  # PowerSGD's bytes, in one round
    else:
        assert sizes in ([c_side, r_side] * 2, [r_side, c_side] * 2)


def test_one_round_powersgd_tensors_alternate_from_either_side() -> None:
    x = torch.randn(12, 30, generator=torch.Generator().manual_seed(6))
    firsts = set()
    for i in range(16):
        wire: list[int] = []
        run_locally(OneRoundPowerSGD(rank=2, alternate=True).exchange(x, Slot(f"w{i}", 0, 1)), wire)
        firsts.add(wire[0])
    assert firsts == {2 * 30 * 4, 2 * 12 * 4}  # so that one step sends about half of both


@pytest.mark.parametrize("alternate", [False, True], ids=["both-sides", "alternate"])
def test_one_round_powersgd_converges_to_the_best_rank_r_error(alternate: bool) -> None:
    m, best = matrix_with_known_rank2_error()
    comp = OneRoundPowerSGD(rank=2, alternate=alternate)
    errors = [
        float((m - run_locally(comp.exchange(m, Slot("w", step, 1))).mean).norm())
        for step in range(30)
    ]
    assert errors[0] > 1.15 * best  # random subspaces first ...
    # ... then power iteration, a step behind: the bases find M's top singular subspaces
    assert errors[-1] == pytest.approx(best, rel=1e-3)
    if alternate:  # one side at a time: never worse than the step before
        assert all(later <= earlier + 1e-3 for earlier, later in itertools.pairwise(errors))
    else:  # both sides: rank up to 4 on the way, below the rank-2 optimum
        assert min(errors) < 0.9 * best


@pytest.mark.parametrize("alternate", [False, True], ids=["both-sides", "alternate"])
def test_one_round_powersgd_two_ranks_project_onto_shared_bases(alternate: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    ranks = [OneRoundPowerSGD(rank=3, alternate=alternate) for _ in range(2)]
    sides: list[bool] = []
    for step in range(4):
        a, b = torch.randn(16, 24, generator=gen), torch.randn(16, 24, generator=gen)
        before = ranks[0]._bases("w", a)
        for bases in (before.columns, before.rows):
            torch.testing.assert_close(bases @ bases.T, torch.eye(3))
        results = drive(
            [c.exchange(x, Slot("w", step, 2, r)) for r, (c, x) in enumerate(zip(ranks, (a, b)))]
        )
        after = [c.bases["w"] for c in ranks]
        # alternating, the side that was sent turns over: X = C M sent makes a new R
        sent_c = not torch.equal(after[0].rows, before.rows) if alternate else None
        if alternate:
            assert sent_c == torch.equal(after[0].columns, before.columns)
            sides.append(sent_c)
        project = one_round_projection(before, sent_c)
        for rank, own in enumerate((a, b)):
            torch.testing.assert_close(results[rank].mean, project((a + b) / 2))
            torch.testing.assert_close(results[rank].local, project(own))
        assert torch.equal(after[0].columns, after[1].columns)
        assert torch.equal(after[0].rows, after[1].rows)
        if not alternate:  # the next bases span the sums: P from M R^T, Q from M^T C
            p = (a + b) @ before.rows.T
            q = before.columns @ (a + b)
            projector = after[0].columns.T @ after[0].columns
            torch.testing.assert_close(projector @ p, p, rtol=0, atol=1e-4)
            projector = after[0].rows.T @ after[0].rows
            torch.testing.assert_close(q @ projector, q, rtol=0, atol=1e-4)
    if alternate:
        assert sides in ([True, False] * 2, [False, True] * 2)


def test_one_round_powersgd_at_full_rank_of_a_square_matrix_is_exact() -> None:
    gen = torch.Generator().manual_seed(8)
    ranks = [OneRoundPowerSGD(rank=6, min_compression=0) for _ in range(2)]
    for step in range(3):
        a, b = torch.randn(6, 6, generator=gen), torch.randn(6, 6, generator=gen)
        results = drive(
            [c.exchange(x, Slot("w", step, 2, r)) for r, (c, x) in enumerate(zip(ranks, (a, b)))]
        )
        torch.testing.assert_close(results[0].mean, (a + b) / 2, rtol=0, atol=1e-5)
        torch.testing.assert_close(results[1].local, b, rtol=0, atol=1e-5)


def test_one_round_powersgd_state_dict_round_trip_gives_identical_next_output() -> None:
    gen = torch.Generator().manual_seed(9)
    grads = [torch.randn(20, 30, generator=gen) for _ in range(4)]
    first = OneRoundPowerSGD(rank=2, alternate=True)
    for step in range(3):
        run_locally(first.exchange(grads[step], Slot("w", step, 1)))
    second = OneRoundPowerSGD(rank=2, alternate=True, seed=123)
    second.load_state_dict(first.state_dict())
    a = run_locally(first.exchange(grads[3], Slot("w", 3, 1))).mean
    b = run_locally(second.exchange(grads[3], Slot("w", 3, 1))).mean
    assert torch.equal(a, b)
    fresh = OneRoundPowerSGD(rank=2, alternate=True, seed=123)
    assert not torch.equal(a, run_locally(fresh.exchange(grads[3], Slot("w", 3, 1))).mean)
    with pytest.raises(ValueError, match="unknown state"):
        second.load_state_dict({"warm": {}})


def test_one_round_powersgd_keeps_going_after_an_all_zero_gradient() -> None:
    comp = OneRoundPowerSGD(rank=2)
    run_locally(comp.exchange(torch.zeros(20, 30), Slot("w", 0, 1)))
    for bases in (comp.bases["w"].columns, comp.bases["w"].rows):
        torch.testing.assert_close(bases @ bases.T, torch.eye(2))  # still bases, not zero
    low_rank = torch.outer(torch.arange(20.0), torch.ones(30))
    outs = [run_locally(comp.exchange(low_rank, Slot("w", s, 1))).mean for s in (1, 2, 3)]
    torch.testing.assert_close(outs[-1], low_rank, rtol=0, atol=1e-3)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(6, 50), seed=st.integers(0, 1000))
def test_orthogonalize_rows(rows: int, cols: int, seed: int) -> None:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    q = orthogonalize_rows(x.clone())
    torch.testing.assert_close(q @ q.T, torch.eye(rows, dtype=torch.float64))
    # rank deficient: a repeated row gets an orthonormal completion, never NaN
    repeated = torch.cat([x[:1], x[:1]]).float()
    out = orthogonalize_rows(repeated)
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out @ out.T, torch.eye(2), rtol=0, atol=1e-5)


def test_orthogonalize_rows_stays_orthogonal_for_nearly_dependent_float32_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(1, 2000, generator=gen)
    rows = torch.cat([base, base + 1e-3 * torch.randn(2, 2000, generator=gen)])
    q = orthogonalize_rows(rows)
    # one projection pass leaves ~1e-1 here in float32; the second brings it to rounding
    torch.testing.assert_close(q @ q.T, torch.eye(3), rtol=0, atol=1e-5)
