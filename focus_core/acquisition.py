"""Where to spend the continuation budget: allocation strategies, one registry.

Each strategy takes the candidate states (critic ensemble predictions, a per-continuation token
cost estimate, an importance weight) and a token budget, and returns how many continuations to
sample from each state. Every strategy obeys the same contract, checked in tests:

* the estimated cost ``sum(counts * cost)`` never exceeds the budget;
* continuations come in chunks of ``chunk_size`` and a state gets at most ``max_per_state`` in
  total, counting the ones it already got in earlier rounds (``uniform_all`` is VinePPO's fixed K
  per state and ignores the chunk size and cap);
* the result depends only on the inputs and the request's ``seed``.

Settings (chunk size, cap, ε share, VinePPO's K, jitter) come from ``AcquisitionConfig``; a
``Request`` adds the token budget and the seed of one allocation.

The strategies (method.md §7, §9.4):

  uniform_all     VinePPO: K continuations per state, states in random order, until the budget ends (the
                  last ones get what the budget still pays)
  uniform_random  chunks to uniformly random states
  ensemble_std    chunks to the states the ensemble disagrees on most (query by committee)
  eer_diag        greedy expected error reduction per token, each state on its own (T7)
  ivr_greedy      greedy integrated variance reduction per token over the ensemble covariance (T9);
                  the FOCUS default
  neyman          stratified-sampling allocation n_s ∝ sqrt(W_s v_a(s) / c_s)
  entropy         ARPO/AEPO-style: chunks to the states where the policy's next-action entropy is highest
                  (from the rollouts' own log-probs), in passes; needs no critic
  oracle          greedy reduction of the *true* squared error of the value used for advantages
                  (needs the exact values; benchmarks only)

The critic-driven strategies (ensemble_std, eer_diag, ivr_greedy) first spend ``eps_uniform`` of the
budget on uniformly random states, so active selection cannot starve the critic of an unbiased
sample of states (method.md §7.5).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from focus_core.config import AcquisitionConfig

CRITIC_FREE_STRATEGIES = ("uniform_all", "uniform_random", "entropy")  # run without a fitted critic
VALUE_CLIP = (0.05, 0.95)  # v_a = μ(1−μ) is computed on μ clipped here, so no state looks noise-free


@dataclass(frozen=True)
class Candidates:
    """The states a strategy may branch from, as parallel arrays over S states.

    member_predictions: [M, S] each critic member's value of each state.
    cost:               [S] estimated generated tokens of one continuation from the state.
    weight:             [S] how much the state's value error matters: the advantage sensitivity
                        W_k of its segment index (method.md §5.3) times how often it occurs.
    already:            [S] returns the state already has: own returns of its main episodes and earlier
                        rounds' continuations (the cap counts them; eer_diag and neyman start from them).
    unseen:             [S] of those, the returns the critic was not fitted on (a critic of an earlier
                        iteration has seen none of this iteration's): ivr_greedy conditions on them first.
    entropy:            [S] the policy's next-action entropy at the state (``entropy`` strategy).
    true_value:         [S] exact V^π(s), only for the ``oracle`` strategy in benchmarks.
    """

    member_predictions: np.ndarray
    cost: np.ndarray
    weight: np.ndarray
    already: np.ndarray | None = None
    unseen: np.ndarray | None = None
    entropy: np.ndarray | None = None
    true_value: np.ndarray | None = None

    def __post_init__(self) -> None:
        m = np.asarray(self.member_predictions)
        if m.ndim != 2 or m.shape[0] < 2:
            raise ValueError(f"member_predictions must be [members >= 2, states], got shape {m.shape}")
        s = m.shape[1]
        for name in ("cost", "weight", "already", "unseen", "entropy", "true_value"):
            value = getattr(self, name)
            if value is not None and np.shape(value) != (s,):
                raise ValueError(f"Candidates.{name} must have one entry per state ({s}), got {np.shape(value)}")
        if (np.asarray(self.cost) <= 0).any():
            raise ValueError("every continuation cost estimate must be > 0 tokens")
        if (np.asarray(self.weight) < 0).any():
            raise ValueError("state weights must be >= 0")

    @property
    def n_states(self) -> int:
        return self.member_predictions.shape[1]

    @property
    def mean(self) -> np.ndarray:
        return self.member_predictions.mean(axis=0)

    @property
    def variance(self) -> np.ndarray:
        return self.member_predictions.var(axis=0, ddof=1)

    @property
    def outcome_variance(self) -> np.ndarray:
        """v_a(s) = μ(1−μ): the variance of one continuation's return (Bernoulli rewards)."""
        mu = np.clip(self.mean, *VALUE_CLIP)
        return mu * (1 - mu)

    @property
    def already_counts(self) -> np.ndarray:
        return np.zeros(self.n_states, dtype=np.int64) if self.already is None else np.asarray(self.already)


@dataclass(frozen=True)
class Request:
    """One allocation to make: the token budget, the acquisition settings and the random seed."""

    budget_tokens: float
    config: AcquisitionConfig = field(default_factory=AcquisitionConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.budget_tokens < 0:
            raise ValueError(f"budget_tokens must be >= 0, got {self.budget_tokens}")


@dataclass
class Allocation:
    """Continuations per state, why each state got them, and the first-round score."""

    counts: np.ndarray  # [S] int
    reason: np.ndarray  # [S] str: which rule first gave the state continuations ('' if none)
    score: np.ndarray  # [S] the strategy's score of each state before any pick (NaN if it has none)
    estimated_tokens: float = 0.0
    picks: list[int] = field(default_factory=list)  # state index of each chunk, in order

    def give(self, state: int, n: int, cost: float, reason: str) -> None:
        self.counts[state] += n
        self.estimated_tokens += n * cost
        if not self.reason[state]:
            self.reason[state] = reason
        self.picks.append(state)


STRATEGIES: dict[str, Callable[[Candidates, Request], Allocation]] = {}


def register_strategy(name: str):
    def add(fn: Callable[[Candidates, Request], Allocation]):
        if name in STRATEGIES:
            raise ValueError(f"acquisition strategy {name!r} is registered twice")
        STRATEGIES[name] = fn
        return fn

    return add


def allocate(candidates: Candidates, request: Request) -> Allocation:
    """Run ``request.config.strategy``; the result is checked against the budget before it is returned."""
    strategy = request.config.strategy
    try:
        fn = STRATEGIES[strategy]
    except KeyError:
        raise ValueError(f"unknown acquisition strategy {strategy!r}; known: {', '.join(sorted(STRATEGIES))}") from None
    allocation = fn(candidates, request)
    spent = float(np.dot(allocation.counts, candidates.cost))
    if spent > request.budget_tokens * (1 + 1e-9):
        raise AssertionError(f"{strategy} allocated {spent} tokens over a budget of {request.budget_tokens}")
    return allocation


# --------------------------------------------------------------------------------------------
# Shared machinery
# --------------------------------------------------------------------------------------------


def _empty(n: int) -> Allocation:
    return Allocation(
        counts=np.zeros(n, dtype=np.int64), reason=np.full(n, "", dtype=object), score=np.full(n, np.nan)
    )


class _Budget:
    """Tracks the estimated tokens left and which states can still take a chunk."""

    def __init__(self, candidates: Candidates, request: Request, allocation: Allocation, limit: float):
        self.cost = np.asarray(candidates.cost, dtype=np.float64)
        self.already = candidates.already_counts
        self.config, self.allocation, self.limit = request.config, allocation, limit

    def left(self) -> float:
        return self.limit - self.allocation.estimated_tokens

    def open_states(self, n: int | None = None) -> np.ndarray:
        """Boolean [S]: the state can take ``n`` more continuations (default one chunk)."""
        n = self.config.chunk_size if n is None else n
        fits = n * self.cost <= self.left() + 1e-9
        under_cap = self.already + self.allocation.counts + n <= self.config.max_per_state
        return fits & under_cap


def _spend_uniform_share(candidates: Candidates, request: Request, allocation: Allocation,
                         rng: np.random.Generator, limit: float, reason: str) -> None:
    """Give chunks to uniformly random open states until ``limit`` estimated tokens are used."""
    budget = _Budget(candidates, request, allocation, limit)
    while True:
        open_idx = np.flatnonzero(budget.open_states())
        if open_idx.size == 0:
            return
        state = int(rng.choice(open_idx))
        allocation.give(state, request.config.chunk_size, budget.cost[state], reason)


def _greedy(candidates: Candidates, request: Request, allocation: Allocation,
            gain_per_token: Callable[[], np.ndarray], on_pick: Callable[[int], None], reason: str) -> None:
    """Repeatedly give a chunk to the open state with the largest ``gain_per_token()``."""
    budget = _Budget(candidates, request, allocation, request.budget_tokens)
    while True:
        open_mask = budget.open_states()
        if not open_mask.any():
            return
        scores = np.where(open_mask, gain_per_token(), -np.inf)
        state = int(np.argmax(scores))
        allocation.give(state, request.config.chunk_size, budget.cost[state], reason)
        on_pick(state)


def _chunks_in_passes(candidates: Candidates, request: Request, allocation: Allocation, order: np.ndarray,
                      reason: str) -> None:
    """One chunk per open state in ``order``, pass after pass, until no state can take one."""
    budget = _Budget(candidates, request, allocation, request.budget_tokens)
    while True:
        progressed = False
        for state in order:
            if budget.open_states()[state]:
                allocation.give(int(state), request.config.chunk_size, budget.cost[state], reason)
                progressed = True
        if not progressed:
            return


def _eps_share(candidates: Candidates, request: Request, allocation: Allocation) -> None:
    rng = np.random.default_rng(request.seed)
    share = request.config.eps_uniform * request.budget_tokens
    _spend_uniform_share(candidates, request, allocation, rng, share, "eps_uniform")


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------


@register_strategy("uniform_all")
def uniform_all(candidates: Candidates, request: Request) -> Allocation:
    """VinePPO: ``vine_k`` continuations for each state, in random order, while the budget lasts.

    Where the budget cannot pay a state's K, the state gets as many as it can pay (VinePPO has no budget;
    a matched budget must not be left unspent because K continuations are a coarse unit)."""
    allocation = _empty(candidates.n_states)
    rng = np.random.default_rng(request.seed)
    left = request.budget_tokens
    for state in rng.permutation(candidates.n_states):
        cost = float(candidates.cost[state])
        n = min(request.config.vine_k, int((left + 1e-9) // cost))
        if n >= 1:
            allocation.give(int(state), n, cost, "uniform_all")
            left -= n * cost
    return allocation


@register_strategy("uniform_random")
def uniform_random(candidates: Candidates, request: Request) -> Allocation:
    allocation = _empty(candidates.n_states)
    rng = np.random.default_rng(request.seed)
    _spend_uniform_share(candidates, request, allocation, rng, request.budget_tokens, "uniform_random")
    return allocation


@register_strategy("ensemble_std")
def ensemble_std(candidates: Candidates, request: Request) -> Allocation:
    """One chunk per state in order of decreasing ensemble std, in passes until the budget ends."""
    allocation = _empty(candidates.n_states)
    std = np.sqrt(candidates.variance)
    allocation.score[:] = std
    _eps_share(candidates, request, allocation)
    _chunks_in_passes(candidates, request, allocation, np.argsort(-std, kind="stable"), "ensemble_std")
    return allocation


def expected_error_reduction(prior_var: np.ndarray, outcome_var: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Δ(s, n) = σ⁴ n / (v_a + n σ²): variance removed by n returns at one state (method.md §7.2, T7)."""
    return prior_var**2 * n / (outcome_var + n * prior_var)


@register_strategy("eer_diag")
def eer_diag(candidates: Candidates, request: Request) -> Allocation:
    """Greedy on W_s [Δ(s, n+k) − Δ(s, n)] / (k c_s), each state's variance on its own."""
    allocation = _empty(candidates.n_states)
    prior_var = candidates.variance + request.config.jitter
    outcome_var, k = candidates.outcome_variance, request.config.chunk_size
    per_token = candidates.weight / (k * np.asarray(candidates.cost, dtype=np.float64))

    def gain_per_token() -> np.ndarray:
        n = allocation.counts + candidates.already_counts.astype(np.float64)
        gain = expected_error_reduction(prior_var, outcome_var, n + k) - expected_error_reduction(
            prior_var, outcome_var, n
        )
        return gain * per_token

    allocation.score[:] = gain_per_token()
    _eps_share(candidates, request, allocation)
    _greedy(candidates, request, allocation, gain_per_token, lambda state: None, "eer_diag")
    return allocation


class IntegratedVariance:
    """Greedy conditioning of the ensemble covariance Σ = F Fᵀ + τ² I, kept in factored form.

    Observing k continuations at state s (noise v_a(s)/k) updates Σ ← Σ − c cᵀ / (Σ_ss + v_a/k)
    with c = Σ[:, s], and the integrated-variance gain of that observation is
    G(s) = Σ_j w_j Σ_js² / (Σ_ss + v_a(s)/k) (method.md §7.3, T9).

    Σ is never formed. Each state picked so far gets its own latent coordinate for its jitter, so
    Σ = G C Gᵀ + τ² diag(not yet picked) with G = [F, τ·e_picked] and C the latent covariance, and
    every quantity the greedy loop needs (the picked column, the weighted squared column norms,
    the diagonal) is updated in O(S·M + (M + picked)²) per pick instead of O(S²). The result equals
    the dense rank-1 updates exactly (tests compare them on random problems).
    """

    def __init__(self, member_predictions: np.ndarray, weight: np.ndarray, outcome_noise: np.ndarray,
                 jitter: float):
        members = np.asarray(member_predictions, dtype=np.float64)
        m, s = members.shape
        self.f = (members - members.mean(axis=0)).T / np.sqrt(m - 1)  # [S, M]
        self.w = np.asarray(weight, dtype=np.float64)
        self.noise = np.asarray(outcome_noise, dtype=np.float64)  # v_a(s)/k for one chunk
        self.tau2 = float(jitter)
        self.n_latent = m
        self.latent_cov = np.eye(m)  # grows by one coordinate per newly picked state
        self.latent_of = np.full(s, -1)  # latent coordinate of each picked state's jitter, -1 if none
        self.picked_states: list[int] = []
        f, w, tau2 = self.f, self.w, self.tau2
        self.diag = (f * f).sum(1) + tau2
        # Σ_j w_j Σ_js² for Σ = F Fᵀ + τ² I, expanded so it costs O(S M²).
        fw_f = f.T @ (w[:, None] * f)
        self.sq_norm = ((f @ fw_f) * f).sum(1) + 2 * tau2 * w * (f * f).sum(1) + tau2**2 * w

    def gains(self) -> np.ndarray:
        """Integrated variance reduction of one chunk at each state: [S]."""
        return self.sq_norm / (self.diag + self.noise)

    def _apply_g(self, latent_vec: np.ndarray) -> np.ndarray:
        """G @ v for a latent vector v: [S]."""
        out = self.f @ latent_vec[: self.f.shape[1]]
        if self.picked_states:
            out[self.picked_states] += np.sqrt(self.tau2) * latent_vec[self.f.shape[1]:self.n_latent]
        return out

    def _apply_gt(self, state_vec: np.ndarray) -> np.ndarray:
        """Gᵀ @ u for a state vector u: [latent]."""
        out = np.empty(self.n_latent)
        out[: self.f.shape[1]] = self.f.T @ state_vec
        out[self.f.shape[1]:] = np.sqrt(self.tau2) * state_vec[self.picked_states]
        return out

    def _sigma_times(self, state_vec: np.ndarray) -> np.ndarray:
        """Σ @ u with the current (conditioned) Σ."""
        out = self._apply_g(self.latent_cov @ self._apply_gt(state_vec))
        unpicked = self.latent_of < 0
        out[unpicked] += self.tau2 * state_vec[unpicked]
        return out

    def _add_latent(self, state: int) -> None:
        """Move state's jitter τ² e_s into a latent coordinate of its own (Σ is unchanged)."""
        n = self.n_latent
        grown = np.zeros((n + 1, n + 1))
        grown[:n, :n] = self.latent_cov
        grown[n, n] = 1.0
        self.latent_cov = grown
        self.latent_of[state] = n
        self.picked_states.append(state)
        self.n_latent = n + 1

    def condition(self, state: int, noise: float | None = None) -> None:
        """Condition Σ on one chunk of continuations at ``state`` (or on an observation of variance ``noise``)."""
        if self.latent_of[state] < 0:
            self._add_latent(state)
        g_row = np.zeros(self.n_latent)
        g_row[: self.f.shape[1]] = self.f[state]
        g_row[self.latent_of[state]] = np.sqrt(self.tau2)
        c_latent = self.latent_cov @ g_row
        column = self._apply_g(c_latent)  # Σ[:, state]
        denominator = column[state] + (self.noise[state] if noise is None else noise)
        sigma_w_column = self._sigma_times(self.w * column)
        w_column_sq = float(np.dot(self.w, column * column))
        self.sq_norm += (-2.0 * column * sigma_w_column + column**2 * w_column_sq / denominator) / denominator
        np.maximum(self.sq_norm, 0.0, out=self.sq_norm)  # guard tiny negative rounding
        self.diag -= column**2 / denominator
        self.latent_cov -= np.outer(c_latent, c_latent) / denominator


@register_strategy("ivr_greedy")
def ivr_greedy(candidates: Candidates, request: Request) -> Allocation:
    """Greedy integrated variance reduction per token, with an ε-uniform share first (method.md §9.4)."""
    allocation = _empty(candidates.n_states)
    cost = np.asarray(candidates.cost, dtype=np.float64)
    k = request.config.chunk_size
    ivr = IntegratedVariance(candidates.member_predictions, candidates.weight,
                             candidates.outcome_variance / k, request.config.jitter)
    if candidates.unseen is not None:  # returns the critic has not been fitted on are known: condition first
        for state in np.flatnonzero(np.asarray(candidates.unseen) > 0):
            ivr.condition(int(state), noise=candidates.outcome_variance[state] / candidates.unseen[state])
    allocation.score[:] = ivr.gains() / (k * cost)
    _eps_share(candidates, request, allocation)
    for state in allocation.picks:  # what the ε share will observe is known: condition on it
        ivr.condition(state)
    _greedy(candidates, request, allocation, lambda: ivr.gains() / (k * cost), ivr.condition, "ivr_greedy")
    return allocation


@register_strategy("neyman")
def neyman(candidates: Candidates, request: Request) -> Allocation:
    """n_s ∝ sqrt(W_s v_a(s) / c_s), scaled to the budget, capped, rounded to whole chunks."""
    allocation = _empty(candidates.n_states)
    cost = np.asarray(candidates.cost, dtype=np.float64)
    share = np.sqrt(candidates.weight * candidates.outcome_variance / cost)
    allocation.score[:] = share
    room = (request.config.max_per_state - candidates.already_counts).clip(min=0)
    k = request.config.chunk_size
    # Water-filling: scale the ideal counts to the budget, freeze the states that hit the cap,
    # and rescale the rest with what is left, until nothing new hits the cap.
    ideal = np.zeros(candidates.n_states)
    free = (room >= k) & (share > 0)
    left = request.budget_tokens
    while free.any():
        ideal[free] = share[free] * left / np.dot(share[free], cost[free])
        capped = free & (ideal >= room)
        if not capped.any():
            break
        ideal[capped] = room[capped]
        left -= float(np.dot(room[capped], cost[capped]))
        free &= ~capped
    chunks = np.floor(ideal / k).astype(np.int64)
    while np.dot(chunks * k, cost) > request.budget_tokens + 1e-9:  # rounding safety
        chunks[np.argmax(chunks * cost)] -= 1
    for state in np.flatnonzero(chunks):
        allocation.give(int(state), int(chunks[state]) * k, cost[state], "neyman")
    # Hand out the rounding remainder by the largest missing fraction of a chunk.
    budget = _Budget(candidates, request, allocation, request.budget_tokens)
    for state in np.argsort(-(ideal / k - chunks), kind="stable"):
        if budget.open_states()[state]:
            allocation.give(int(state), k, cost[state], "neyman")
    return allocation


@register_strategy("entropy")
def entropy(candidates: Candidates, request: Request) -> Allocation:
    """One chunk per state in order of decreasing next-action entropy (ties broken at random), in passes
    until the budget ends: branch where the policy is least decided (ARPO/AEPO), whatever the critic says."""
    if candidates.entropy is None:
        raise ValueError("the entropy strategy needs Candidates.entropy (the policy's next-action entropy per state)")
    allocation = _empty(candidates.n_states)
    score = np.asarray(candidates.entropy, dtype=np.float64)
    allocation.score[:] = score
    tie_break = np.random.default_rng(request.seed).random(candidates.n_states)
    _chunks_in_passes(candidates, request, allocation, np.lexsort((tie_break, -score)), "entropy")
    return allocation


def shrinkage_squared_error(bias: np.ndarray, prior_var: np.ndarray, model_outcome_var: np.ndarray,
                            true_outcome_var: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Expected squared error of ``combine_estimates`` after n returns, given the critic's true bias.

    With precision P = 1/σ² + n/v_a, the estimate's error is (b/σ² + n(ȳ − V)/v_a)/P, whose mean
    square is (b²/σ⁴ + n v/v_a²)/P² where v is the true outcome variance.
    """
    precision = 1.0 / prior_var + n / model_outcome_var
    return (bias**2 / prior_var**2 + n * true_outcome_var / model_outcome_var**2) / precision**2


@register_strategy("oracle")
def oracle(candidates: Candidates, request: Request) -> Allocation:
    """Greedy reduction of the true squared error of the advantage value V̂ per token (benchmarks only)."""
    if candidates.true_value is None:
        raise ValueError("the oracle strategy needs Candidates.true_value (exact V^π); it is for benchmarks only")
    allocation = _empty(candidates.n_states)
    cost = np.asarray(candidates.cost, dtype=np.float64)
    truth = np.asarray(candidates.true_value, dtype=np.float64)
    bias = candidates.mean - truth
    prior_var = candidates.variance + request.config.jitter
    model_var, true_var = candidates.outcome_variance, truth * (1 - truth)
    k = request.config.chunk_size

    def gain_per_token() -> np.ndarray:
        n = allocation.counts.astype(np.float64)
        before = shrinkage_squared_error(bias, prior_var, model_var, true_var, n)
        after = shrinkage_squared_error(bias, prior_var, model_var, true_var, n + k)
        return candidates.weight * (before - after) / (k * cost)

    allocation.score[:] = gain_per_token()
    _greedy(candidates, request, allocation, gain_per_token, lambda state: None, "oracle")
    return allocation


# --------------------------------------------------------------------------------------------
# Weights and the value used for advantages
# --------------------------------------------------------------------------------------------


def advantage_sensitivity(segment_idx: np.ndarray, *, gamma: float = 1.0, lam: float = 0.9) -> np.ndarray:
    """W_k = Σ_j (∂A_j/∂V(s_k))² = 1 + Σ_{m<k} (γ(1−λ))² (γλ)^{2m}  (method.md §5.3, T6).

    How much a squared error in V(s_k) inflates the squared error of all segment advantages.
    """
    k = np.asarray(segment_idx, dtype=np.float64)
    a, r = (gamma * (1 - lam)) ** 2, (gamma * lam) ** 2
    if r == 1.0:
        return 1.0 + a * k
    return 1.0 + a * (1 - r**k) / (1 - r)


def combine_estimates(critic_mean: np.ndarray, critic_var: np.ndarray, mc_mean: np.ndarray,
                      n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Precision-weighted value: (μ/σ² + n ȳ/v_a) / (1/σ² + n/v_a) and its variance (method.md §9.5, T8).

    ``n`` = 0 returns the critic unchanged (``mc_mean`` is then ignored, NaN allowed there).
    """
    mu = np.asarray(critic_mean, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    clipped = np.clip(mu, *VALUE_CLIP)
    outcome_var = clipped * (1 - clipped)
    prior_precision = 1.0 / np.asarray(critic_var, dtype=np.float64)
    data_precision = n / outcome_var
    mc = np.where(n > 0, np.nan_to_num(np.asarray(mc_mean, dtype=np.float64)), 0.0)
    precision = prior_precision + data_precision
    return (mu * prior_precision + mc * data_precision) / precision, 1.0 / precision
