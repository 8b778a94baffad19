"""Preference polish: the losses against the papers' formulas, pair tokenization, the trainer."""

import math

import numpy as np
import pytest

# ---------------------------------------------------------------- the papers' formulas, written out independently
# (plain Python floats; nothing here imports the project's loss code)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def dpo_paper(c, r, c_ref, r_ref, beta, eps):
    """Rafailov et al. eq. 7 on summed log-probs; conservative DPO's label smoothing eps."""
    h = beta * ((c - c_ref) - (r - r_ref))
    return -(1 - eps) * log_sigmoid(h) - eps * log_sigmoid(-h)


def simpo_paper(c, r, n_c, n_r, beta, gamma, eps):
    """Meng et al. eq. 6: length-normalised rewards beta/|y| log pi(y|x), target margin gamma."""
    h = beta / n_c * c - beta / n_r * r - gamma
    return -(1 - eps) * log_sigmoid(h) - eps * log_sigmoid(-h)


def orpo_paper(c, r, n_c, n_r, lam, eps):
    """Hong et al. eqs. 2, 4, 6, 7: L_SFT + lambda L_OR, odds(y|x) = P / (1 - P), P = exp(mean log-prob)."""
    p_c, p_r = math.exp(c / n_c), math.exp(r / n_r)
    log_or = math.log((p_c / (1 - p_c)) / (p_r / (1 - p_r)))
    sft = -c / n_c
    return sft + lam * (-(1 - eps) * log_sigmoid(log_or) - eps * log_sigmoid(-log_or))


def rpo_term(c, n_c, alpha):
    return -alpha * c / n_c


@pytest.fixture(scope="module")
def logps():
    rng = np.random.default_rng(0)
    n = 16
    lengths_c = rng.integers(3, 60, n).astype(np.float64)
    lengths_r = rng.integers(3, 60, n).astype(np.float64)
    c = -lengths_c * rng.uniform(0.05, 2.0, n)
    r = -lengths_r * rng.uniform(0.05, 2.0, n)
    return c, r, lengths_c, lengths_r, c + rng.normal(0, 3, n), r + rng.normal(0, 3, n)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("sft_weight", [0.0, 0.5])
def test_dpo_loss_is_the_papers(logps, eps, sft_weight):
    from tunix_pipeline.preference import pair_losses

    c, r, nc, nr, c_ref, r_ref = logps
    got, chosen_reward, _ = pair_losses("dpo", c, r, nc, nr, c_ref, r_ref, beta=0.3, label_smoothing=eps,
                                        sft_weight=sft_weight)
    want = [dpo_paper(*x, 0.3, eps) + rpo_term(x[0], n, sft_weight) for x, n in zip(zip(c, r, c_ref, r_ref), nc)]
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(chosen_reward), 0.3 * (c - c_ref), atol=1e-5)


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_simpo_loss_is_the_papers(logps, eps):
    from tunix_pipeline.preference import pair_losses

    c, r, nc, nr, _, _ = logps
    got, _, _ = pair_losses("simpo", c, r, nc, nr, beta=2.0, simpo_gamma=0.7, label_smoothing=eps)
    want = [simpo_paper(*x, 2.0, 0.7, eps) for x in zip(c, r, nc, nr)]
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_orpo_loss_is_the_papers_on_averaged_log_probs(logps, eps):
    from tunix_pipeline.preference import pair_losses

    c, r, nc, nr, _, _ = logps
    got, _, _ = pair_losses("orpo", c, r, nc, nr, orpo_lambda=0.25, label_smoothing=eps)
    want = [orpo_paper(*x, 0.25, eps) for x in zip(c, r, nc, nr)]
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5)


def test_orpo_odds_ratio_term_differs_from_tunix_summed_one():
    """The issue's example: 40-token answers; Tunix sums log-probs, the paper averages them."""

    from tunix_pipeline.preference import pair_losses

    n = 40.0
    c, r = -0.5 * n, -0.9 * n
    paper_term = orpo_paper(c, r, n, n, 1.0, 0.0) - (-c / n)
    got, _, _ = pair_losses("orpo", np.array([c]), np.array([r]), np.array([n]), np.array([n]), orpo_lambda=1.0)
    assert float(got[0]) - (-c / n) == pytest.approx(paper_term, abs=1e-5)
    summed = c - r - (math.log1p(-math.exp(c)) - math.log1p(-math.exp(r)))
    assert abs(-log_sigmoid(summed) - paper_term) > 0.1  # on sums the term is ~1e-7 here: no gradient left


def test_pair_accuracy_counts_ties_half():
    from tunix_pipeline.preference import pair_accuracy

    assert float(pair_accuracy(np.array([1.0, 0.0, 2.0, 3.0]), np.array([0.0, 0.0, 3.0, 3.0]))) == pytest.approx(0.5)
    assert float(pair_accuracy(np.array([1.0, 1.0]), np.array([0.0, 0.0]))) == 1.0
