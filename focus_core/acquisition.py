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

and three rules that predict where the critic is *wrong* rather than where its members disagree (the
ensemble's spread measures variance, but the critic's error is mostly bias and memorised return noise):

  residual_knn    the oracle's greedy rule with the true bias² replaced by a cross-fitted estimate: the critic
                  against the returns of the nearest observed states, each state's own left out
  beta_posterior  the oracle's greedy rule with the bias² replaced by its expectation under a count-aware
                  Beta posterior per state (agreeing returns settle a state)
  novelty         greedy reduction of a kernel estimate's variance: branch where few returns were observed nearby

The critic-driven strategies (ensemble_std, eer_diag, ivr_greedy and the three above) first spend
``eps_uniform`` of the budget on uniformly random states, so active selection cannot starve the critic of an
unbiased sample of states (method.md §7.5).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from focus_core.config import AcquisitionConfig

CRITIC_FREE_STRATEGIES = ("uniform_all", "uniform_random", "entropy")  # run without a fitted critic
VALUE_CLIP = (0.05, 0.95)  # v_a = μ(1−μ) is computed on μ clipped here, so no state looks noise-free


def _out_of_fold_or(oof_mean: np.ndarray | None, critic_mean: np.ndarray) -> np.ndarray:
    """The out-of-fold value where it is known (not None, finite), else the critic's own."""
    critic_mean = np.asarray(critic_mean, dtype=np.float64)
    if oof_mean is None:
        return critic_mean
    oof_mean = np.asarray(oof_mean, dtype=np.float64)
    return np.where(np.isfinite(oof_mean), oof_mean, critic_mean)


@dataclass(frozen=True)
class Observations:
    """States with observed returns: what the error-predicting rules learn the critic's error from.

    features [R, F]; return_sum and return_count [R] (sum and number of the returns observed at each state, all
    of which the critic was fitted on); oof_mean [R] the value of a critic not fitted on the state's returns, or
    None (then ``Candidates.mean``-like in-sample values must be passed as ``critic_mean``); critic_mean [R] the
    value the critic that acquisition reads predicts there.
    """

    features: np.ndarray
    return_sum: np.ndarray
    return_count: np.ndarray
    critic_mean: np.ndarray
    oof_mean: np.ndarray | None = None

    def __post_init__(self) -> None:
        if np.ndim(self.features) != 2:
            raise ValueError(f"Observations.features must be [states, features], got {np.shape(self.features)}")
        r = np.shape(self.features)[0]
        for name in ("return_sum", "return_count", "critic_mean", "oof_mean"):
            value = getattr(self, name)
            if value is not None and np.shape(value) != (r,):
                raise ValueError(f"Observations.{name} must have one entry per state ({r}), got {np.shape(value)}")
        if (np.asarray(self.return_count) < 0).any() or (np.asarray(self.return_sum) < 0).any():
            raise ValueError("Observations: return counts and sums must be >= 0")

    @property
    def n_states(self) -> int:
        return int(np.shape(self.features)[0])

    @property
    def reference_mean(self) -> np.ndarray:
        """The critic value residuals are taken against: out of fold where known, else the critic mean."""
        return _out_of_fold_or(self.oof_mean, self.critic_mean)


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

    What the error-predicting rules (``residual_knn``, ``beta_posterior``, ``novelty``) read:

    features:           [S, F] the critic's input features of each state.
    return_sum:         [S] sum of the returns observed at the state that the critic was fitted on, and
    return_count:       [S] their number (own returns, earlier continuations, returns of passing branches).
    oof_mean:           [S] the value a critic *not* fitted on the state's returns predicts (cross-fitted by task
                        folds in the pipeline, out-of-bag members in the benchmark); without it the rules fall
                        back to the critic mean, whose residuals are shrunk by its own fit.
    observations:       every state with observed returns the rules may learn the critic's error from; None:
                        the candidates themselves (their features, return sums and counts, out-of-fold means).
    observation_row:    [S] each candidate's row in ``observations`` (-1 where it has none).
    """

    member_predictions: np.ndarray
    cost: np.ndarray
    weight: np.ndarray
    already: np.ndarray | None = None
    unseen: np.ndarray | None = None
    entropy: np.ndarray | None = None
    true_value: np.ndarray | None = None
    features: np.ndarray | None = None
    return_sum: np.ndarray | None = None
    return_count: np.ndarray | None = None
    oof_mean: np.ndarray | None = None
    observations: Observations | None = None
    observation_row: np.ndarray | None = None

    def __post_init__(self) -> None:
        m = np.asarray(self.member_predictions)
        if m.ndim != 2 or m.shape[0] < 2:
            raise ValueError(f"member_predictions must be [members >= 2, states], got shape {m.shape}")
        s = m.shape[1]
        for name in ("cost", "weight", "already", "unseen", "entropy", "true_value", "return_sum", "return_count",
                     "oof_mean", "observation_row"):
            value = getattr(self, name)
            if value is not None and np.shape(value) != (s,):
                raise ValueError(f"Candidates.{name} must have one entry per state ({s}), got {np.shape(value)}")
        if self.features is not None and (np.ndim(self.features) != 2 or np.shape(self.features)[0] != s):
            raise ValueError(f"Candidates.features must be [states ({s}), features], got {np.shape(self.features)}")
        if (self.return_sum is None) != (self.return_count is None):
            raise ValueError("Candidates.return_sum and return_count come together (sum and number of returns)")
        if (np.asarray(self.cost) <= 0).any():
            raise ValueError("every continuation cost estimate must be > 0 tokens")
        if (np.asarray(self.weight) < 0).any():
            raise ValueError("state weights must be >= 0")
        if self.observations is not None:
            if self.observation_row is None:
                raise ValueError("Candidates.observations needs observation_row (-1 for a candidate not among them)")
            if self.features is not None and self.observations.features.shape[1] != np.shape(self.features)[1]:
                raise ValueError("Candidates.features and observations.features need the same feature columns")
            row = np.asarray(self.observation_row)
            if ((row < -1) | (row >= self.observations.n_states)).any():
                raise ValueError("Candidates.observation_row must index observations (or be -1)")

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

    def require(self, strategy: str, *names: str) -> None:
        missing = [name for name in names if getattr(self, name) is None]
        if missing:
            raise ValueError(f"the {strategy} strategy needs Candidates.{', Candidates.'.join(missing)}")

    def observed(self) -> tuple[Observations, np.ndarray]:
        """The observed states and each candidate's row among them (the candidates themselves by default)."""
        if self.observations is not None:
            return self.observations, np.asarray(self.observation_row, dtype=np.int64)
        self.require("error-predicting", "features", "return_sum", "return_count")
        own = Observations(np.asarray(self.features, dtype=np.float64), np.asarray(self.return_sum, np.float64),
                           np.asarray(self.return_count, np.float64), self.mean, self.reference_mean)
        return own, np.arange(self.n_states)

    @property
    def reference_mean(self) -> np.ndarray:
        """Each candidate's out-of-fold value where known, else the critic mean."""
        return _out_of_fold_or(self.oof_mean, self.mean)


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
    score: np.ndarray  # [S] how much the strategy wants each state before any pick (higher = more); equal for
    # the uniform rules, whose order is random
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
    allocation.score[:] = 1.0  # every state is wanted alike: the order is random
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
    allocation.score[:] = 1.0  # every state is wanted alike
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
# Error-predicting rules: where the critic is *wrong* (its bias), not where its members disagree
# --------------------------------------------------------------------------------------------


def squared_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[A, B] squared Euclidean distances between the rows of a and b (clipped at 0 against rounding)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    d2 = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T
    return np.maximum(d2, 0.0)


def nearest_rows(query: np.ndarray, reference: np.ndarray, k: int, *, chunk: int = 1024) -> np.ndarray:
    """[Q, min(k, R)] indices of each query row's k nearest reference rows, nearest first (ties by index)."""
    k = min(k, len(reference))
    out = np.empty((len(query), k), dtype=np.int64)
    for start in range(0, len(query), chunk):
        d2 = squared_distances(query[start:start + chunk], reference)
        out[start:start + chunk] = np.argsort(d2, axis=1, kind="stable")[:, :k]
    return out


def beta_posterior(prior_mean: np.ndarray, strength: float, successes: np.ndarray,
                   trials: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance of Beta(κμ + y, κ(1 − μ) + n − y): a critic prior worth κ returns, updated by the n returns
    (summing to y) observed at the state. Returns are Bernoulli here, so agreeing returns settle a state fast:
    μ = 0.3, κ = 4 and two zeros give Beta(1.2, 4.8), mean 0.2 and variance 0.0229 (the prior's was 0.042)."""
    mu = np.clip(np.asarray(prior_mean, dtype=np.float64), 1e-3, 1 - 1e-3)
    a = strength * mu + np.asarray(successes, dtype=np.float64)
    b = strength * (1 - mu) + np.asarray(trials, dtype=np.float64) - np.asarray(successes, dtype=np.float64)
    mean = a / (a + b)
    return mean, mean * (1 - mean) / (a + b + 1)


def knn_residual_error(candidates: Candidates, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Estimated critic error at each candidate, cross-fitted: the critic against its k nearest observed states.

    V̂₋ₛ(s) is the count-weighted mean return of the k observed states nearest to s in feature space, s itself left
    out — a smoother of another inductive bias than the critic's MLP, and one that has not seen the state's own
    returns, which the critic partly memorises. The residual ê = μ(s) − V̂₋ₛ(s) is then an estimate of the critic's
    error μ(s) − V(s) whose noise is se² = p(1 − p)/Σn, p the neighbourhood's pooled return mean (with one
    pseudo-return at μ(s)), so neighbours whose returns agree (a doomed state's zeros) make it small.

    Returns (ê², se², p) per candidate: ê² − se² (floored at 0) estimates the squared bias. A candidate with no
    observed neighbour gets ê = 0 and se² = ∞.

    (Smoothing out-of-fold residuals y − μ₋f of the neighbours instead was measured worse on the critic-budget
    benchmark's tuning seeds: Spearman −0.14 to −0.26 with the actual error, against +0.1 to +0.45 here.)
    """
    obs, row = candidates.observed()
    candidates.require("residual_knn", "features")
    count = np.asarray(obs.return_count, dtype=np.float64)
    have = np.flatnonzero(count > 0)
    s = candidates.n_states
    mean = candidates.mean
    if have.size == 0:
        return np.zeros(s), np.full(s, np.inf), np.clip(mean, *VALUE_CLIP)
    ybar = np.asarray(obs.return_sum, dtype=np.float64)[have] / count[have]
    position = np.full(obs.n_states, -1)
    position[have] = np.arange(have.size)
    own = np.where(row >= 0, position[np.maximum(row, 0)], -1)  # the candidate's own row among the observed
    nbr = nearest_rows(np.asarray(candidates.features, dtype=np.float64),
                       np.asarray(obs.features, dtype=np.float64)[have], k + 1)
    is_own = nbr == own[:, None]
    w = count[have][nbr] * ~is_own
    if nbr.shape[1] == k + 1:
        w[~is_own.any(1), -1] = 0.0  # k neighbours also where the state itself was not among the k + 1
    total = w.sum(1)
    successes = (w * ybar[nbr]).sum(1)
    value = np.divide(successes, total, out=mean.copy(), where=total > 0)
    p = (successes + mean) / (total + 1.0)
    se2 = np.divide(p * (1 - p), total, out=np.full(s, np.inf), where=total > 0)
    return (mean - value) ** 2, se2, p


def _bias_greedy(candidates: Candidates, request: Request, bias_sq: np.ndarray, true_var: np.ndarray,
                 reason: str) -> Allocation:
    """The oracle's greedy loop with an *estimated* squared bias and outcome variance, after the ε share."""
    allocation = _empty(candidates.n_states)
    cost = np.asarray(candidates.cost, dtype=np.float64)
    prior_var = candidates.variance + request.config.jitter
    model_var, k = candidates.outcome_variance, request.config.chunk_size
    true_var = np.clip(true_var, 1e-4, 0.25)

    def gain_per_token() -> np.ndarray:
        n = allocation.counts.astype(np.float64)
        before = shrinkage_squared_error(np.sqrt(bias_sq), prior_var, model_var, true_var, n)
        after = shrinkage_squared_error(np.sqrt(bias_sq), prior_var, model_var, true_var, n + k)
        return candidates.weight * (before - after) / (k * cost)

    allocation.score[:] = gain_per_token()
    _eps_share(candidates, request, allocation)
    _greedy(candidates, request, allocation, gain_per_token, lambda state: None, reason)
    return allocation


@register_strategy("residual_knn")
def residual_knn(candidates: Candidates, request: Request) -> Allocation:
    """The oracle's greedy rule with the true bias² replaced by a cross-fitted estimate, max(ê² − se², 0), where
    ê = μ(s) − V̂₋ₛ(s) compares the critic with the returns of the ``neighbours`` nearest observed states, the
    state's own left out (``knn_residual_error``), and the true outcome variance by p(1 − p) of those returns."""
    error_sq, se2, p = knn_residual_error(candidates, request.config.neighbours)
    return _bias_greedy(candidates, request, np.maximum(error_sq - se2, 0.0), p * (1 - p), "residual_knn")


@register_strategy("beta_posterior")
def beta_posterior_rule(candidates: Candidates, request: Request) -> Allocation:
    """The oracle's greedy rule with the true bias² replaced by its expectation under a count-aware posterior.

    Per state, V ~ Beta(κμ₋f + y, κ(1 − μ₋f) + n − y) (``beta_posterior``; μ₋f the out-of-fold value, else the
    critic mean), so E[(μ − V)²] = (μ − m)² + var, and the outcome variance of a continuation is m(1 − m): a
    doomed state whose returns all agree on 0 is settled, whatever the critic says."""
    candidates.require("beta_posterior", "return_sum", "return_count")
    mean, var = beta_posterior(candidates.reference_mean, request.config.beta_strength, candidates.return_sum,
                               candidates.return_count)
    return _bias_greedy(candidates, request, (candidates.mean - mean) ** 2 + var, mean * (1 - mean), "beta_posterior")


@register_strategy("novelty")
def novelty(candidates: Candidates, request: Request) -> Allocation:
    """Greedy reduction of a kernel estimate's variance v_a/(1 + ρ) per token, ρ(s) the kernel-weighted count of
    observed returns near s: rare states hold the error. A chunk at s adds k returns at s, so ρ grows there and,
    by the kernel, at its neighbours. Bandwidth: ``novelty_bandwidth`` × the median distance from a candidate
    to its nearest other observed state."""
    candidates.require("novelty", "features")
    obs, row = candidates.observed()
    x = np.asarray(candidates.features, dtype=np.float64)
    ref = np.asarray(obs.features, dtype=np.float64)
    count = np.asarray(obs.return_count, dtype=np.float64)
    s = candidates.n_states
    density = np.zeros(s)
    nearest = np.full(s, np.inf)
    chunk = 1024  # two passes over blocks of candidates: the S × R distances are never held at once
    for start in range(0, s if len(ref) else 0, chunk):
        d2 = squared_distances(x[start:start + chunk], ref)
        own = row[start:start + chunk]
        d2[np.flatnonzero(own >= 0), own[own >= 0]] = np.inf  # not its own row
        d2[:, count == 0] = np.inf
        nearest[start:start + chunk] = d2.min(1)
    finite = nearest[np.isfinite(nearest)]
    scale = float(np.median(finite)) if finite.size else 0.0
    h2 = request.config.novelty_bandwidth**2 * (scale if scale > 0 else 1.0)
    for start in range(0, s if len(ref) else 0, chunk):
        density[start:start + chunk] = np.exp(-squared_distances(x[start:start + chunk], ref) / (2 * h2)) @ count
    allocation = _empty(s)
    cost = np.asarray(candidates.cost, dtype=np.float64)
    k = request.config.chunk_size
    per_token = candidates.weight * candidates.outcome_variance / (k * cost)

    def gain_per_token() -> np.ndarray:
        return per_token * (1.0 / (1.0 + density) - 1.0 / (1.0 + density + k))

    def on_pick(state: int) -> None:
        density[:] += k * np.exp(-((x - x[state]) ** 2).sum(1) / (2 * h2))

    allocation.score[:] = gain_per_token()
    _eps_share(candidates, request, allocation)
    for state in allocation.picks:
        on_pick(state)
    _greedy(candidates, request, allocation, gain_per_token, on_pick, "novelty")
    return allocation


# --------------------------------------------------------------------------------------------
# Weights and the value used for advantages
# --------------------------------------------------------------------------------------------


def advantage_sensitivity(segment_idx: np.ndarray, *, gamma: float, lam: float) -> np.ndarray:
    """W_k = Σ_j (∂A_j/∂V(s_k))² = 1 + Σ_{m<k} (γ(1−λ))² (γλ)^{2m}  (method.md §5.3, T6).

    How much a squared error in V(s_k) inflates the squared error of all segment advantages.
    """
    k = np.asarray(segment_idx, dtype=np.float64)
    a, r = (gamma * (1 - lam)) ** 2, (gamma * lam) ** 2
    if r == 1.0:
        return 1.0 + a * k
    return 1.0 + a * (1 - r**k) / (1 - r)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (ties get their average rank) over the pairs where both are finite; NaN with
    fewer than 3 such pairs or when either side is constant (a uniform rule's equal scores rank nothing)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    keep = np.isfinite(a) & np.isfinite(b)
    if keep.sum() < 3:
        return float("nan")
    ra, rb = _average_ranks(a[keep]), _average_ranks(b[keep])
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _average_ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=np.float64)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return (sums / counts)[inverse]


def calibrated_variance(critic_mean: np.ndarray, critic_var: np.ndarray, mc_mean: np.ndarray,
                        n: np.ndarray) -> tuple[np.ndarray, float]:
    """The critic's variance scaled up to the error it makes, and the scale (empirical Bayes).

    Over the rows with returns, E[(ȳ − μ)²] = τ² + E[v_a/n]: the critic's squared error τ² plus the returns' own
    noise (v_a = μ(1−μ), μ clipped as in ``combine_estimates``). When the mean ensemble variance is below
    τ̂² = mean((ȳ − μ)²) − mean(v_a/n), every variance is multiplied by τ̂² / mean(σ²), which keeps the states'
    ranking; otherwise (or with no returns) the variances are returned as they are, scale 1. ``critic_mean`` must
    be out-of-fold (not fitted on the returns it is compared with), or τ̂² is too small.
    """
    var = np.asarray(critic_var, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    has = n > 0
    if not has.any():
        return var, 1.0
    mu = np.asarray(critic_mean, dtype=np.float64)[has]
    clipped = np.clip(mu, *VALUE_CLIP)
    error = float(np.mean((np.asarray(mc_mean, dtype=np.float64)[has] - mu) ** 2))
    tau2 = error - float(np.mean(clipped * (1 - clipped) / n[has]))
    scale = max(1.0, tau2 / float(np.mean(var[has])))
    return var * scale, scale


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
