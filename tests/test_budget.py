"""Token budget: the matched-budget arithmetic (T11) and a ledger that can never overspend."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from focus_core.budget import BudgetExceeded, BudgetLedger, matched_budget, spend_margin
from focus_core.schemas import BUDGET_KINDS, validate_table


def test_t11_matched_budget():
    total, branch = matched_budget(prompts=2, mean_episode_tokens=5000, group_size_grpo=8, group_size_main=4)
    assert (total, branch) == (80_000, 40_000)


def test_matched_budget_without_branching_leaves_nothing_for_branches():
    total, branch = matched_budget(prompts=3, mean_episode_tokens=1000, group_size_grpo=8, group_size_main=8)
    assert (total, branch) == (24_000, 0)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((2, 5000, 4, 8), "group_size_main \\(8\\) > group_size_grpo \\(4\\)"),
        ((0, 5000, 8, 4), "must be >= 1"),
        ((2, 0, 8, 4), "mean_episode_tokens must be > 0"),
    ],
)
def test_matched_budget_rejects_impossible_inputs(args, expected):
    with pytest.raises(ValueError, match=expected):
        matched_budget(*args)


def test_charges_are_summed_by_kind():
    ledger = BudgetLedger(100)
    ledger.charge("main", 40)
    ledger.charge("branch", 25, round_idx=0)
    ledger.charge("branch", 10, round_idx=1)
    ledger.charge("summary", 5)
    assert ledger.by_kind == {"main": 40, "branch": 35, "summary": 5}
    assert (ledger.spent, ledger.remaining) == (80, 20)


def test_by_kind_lists_every_kind_even_when_empty():
    assert BudgetLedger(10).by_kind == dict.fromkeys(BUDGET_KINDS, 0)


def test_charge_over_budget_raises_and_records_nothing():
    ledger = BudgetLedger(100)
    ledger.charge("main", 90)
    with pytest.raises(BudgetExceeded, match="spent 90 of 100, asked 11"):
        ledger.charge("branch", 11)
    assert ledger.spent == 90 and ledger.by_kind["branch"] == 0


def test_exact_fit_is_allowed():
    ledger = BudgetLedger(100)
    ledger.charge("main", 100)
    assert ledger.remaining == 0 and ledger.can_afford(0) and not ledger.can_afford(1)


def test_try_charge_charges_only_what_fits():
    ledger = BudgetLedger(50)
    assert ledger.try_charge("branch", 30)
    assert not ledger.try_charge("branch", 30)
    assert ledger.try_charge("branch", 20)
    assert ledger.by_kind["branch"] == 50


def test_unknown_kind_names_the_allowed_kinds():
    with pytest.raises(ValueError, match="unknown budget kind 'tool'; allowed kinds: main, branch, summary"):
        BudgetLedger(10).charge("tool", 1)
    with pytest.raises(ValueError, match="unknown budget kind"):
        BudgetLedger(10).try_charge("tool", 1)


@pytest.mark.parametrize("tokens", [-1, 2.5, True, "3"])
def test_token_counts_must_be_non_negative_ints(tokens):
    with pytest.raises(ValueError, match="tokens must be a non-negative int"):
        BudgetLedger(10).charge("main", tokens)


def test_numpy_integers_are_accepted():
    ledger = BudgetLedger(np.int64(10))
    ledger.charge("main", np.int32(4))
    assert ledger.spent == 4 and type(ledger.spent) is int


def test_rows_validate_as_the_budget_ledger_table():
    ledger = BudgetLedger(80_000)
    ledger.charge("main", 40_000)
    ledger.charge("branch", 12_000, round_idx=1)
    ledger.charge("branch", 9_000, round_idx=0)
    ledger.charge("summary", 500, round_idx=0)
    rows = ledger.rows(run_id="run-a", iteration=2, policy_version=2)
    assert [(row["round"], row["kind"], row["tokens"]) for row in rows] == [
        (0, "main", 40_000),
        (0, "branch", 9_000),
        (0, "summary", 500),
        (1, "branch", 12_000),
    ]
    table = validate_table("budget_ledger", pa.Table.from_pylist(rows))
    assert table.column("budget").to_pylist() == [80_000] * 4
    assert sum(table.column("tokens").to_pylist()) == ledger.spent


CHARGES = st.lists(
    st.tuples(st.sampled_from(BUDGET_KINDS), st.integers(0, 500), st.integers(0, 3), st.booleans()),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(budget=st.integers(0, 5000), charges=CHARGES)
def test_ledger_never_exceeds_its_budget(budget, charges):
    ledger = BudgetLedger(budget)
    accepted = dict.fromkeys(BUDGET_KINDS, 0)
    for kind, tokens, round_idx, use_try in charges:
        fits = ledger.spent + tokens <= budget
        if use_try:
            assert ledger.try_charge(kind, tokens, round_idx=round_idx) is fits
        elif fits:
            ledger.charge(kind, tokens, round_idx=round_idx)
        else:
            with pytest.raises(BudgetExceeded):
                ledger.charge(kind, tokens, round_idx=round_idx)
        if fits:
            accepted[kind] += tokens
        assert 0 <= ledger.spent <= budget
        assert ledger.spent + ledger.remaining == budget
    assert ledger.by_kind == accepted
    rows = ledger.rows(run_id="r", iteration=0, policy_version=0)
    assert sum(row["tokens"] for row in rows) == ledger.spent


def test_spend_margin_worked_example():
    assert spend_margin(np.array([2, 1]), np.array([10.0, 20.0]), cost_cv=0.5, sds=2.0) == pytest.approx(
        2 * np.sqrt(150.0))
    assert spend_margin(np.array([0, 0]), np.array([10.0, 20.0]), cost_cv=0.5, sds=2.0) == 0.0


def test_a_plan_two_sds_below_its_budget_rarely_overspends():
    # Continuation costs drawn from a gamma with the stated coefficient of variation (skewed like episode
    # lengths): a plan that fills budget − margin overspends the budget in about 1 of 40 draws at 2 sd.
    rng = np.random.default_rng(0)
    counts, cost, cv = np.full(60, 2), rng.uniform(20, 200, 60), 0.8
    budget = float(np.dot(counts, cost)) + spend_margin(counts, cost, cv, sds=2.0)
    shape = 1 / cv**2
    each = np.repeat(cost, counts)  # one independent draw per continuation
    draws = rng.gamma(shape, each / shape, size=(4000, len(each))).sum(axis=1)
    share = float(np.mean(draws > budget))
    assert 0.005 < share < 0.05
    no_margin = float(np.mean(draws > float(np.dot(counts, cost))))
    assert no_margin > 0.4


def test_spend_margin_counts_the_shared_error_of_an_estimated_price():
    counts, cost = np.array([2, 1]), np.array([10.0, 20.0])
    exact = spend_margin(counts, cost, cost_cv=0.5, sds=2.0)
    estimated = spend_margin(counts, cost, cost_cv=0.5, sds=2.0, price_observations=np.array([1, 1]))
    assert estimated == pytest.approx(2 * np.sqrt(50 + 50 + 100 + 50))
    # More observed costs make a price surer, and the margin shrinks back toward the exact-price one.
    surer = spend_margin(counts, cost, cost_cv=0.5, sds=2.0, price_observations=np.array([1000, 1000]))
    assert exact < surer < estimated


def test_a_plan_priced_from_few_costs_overspends_rarely_with_the_price_error_counted():
    # Each state's true mean cost is unknown; its price is the mean of 2 observed costs and a prior
    # pseudo-observation at the true mean. Continuations of one state share the price's error.
    rng = np.random.default_rng(1)
    n_states, cv, shape = 40, 0.8, 1 / 0.8**2
    truth = rng.uniform(20, 200, n_states)
    counts = np.full(n_states, 5)
    overspent = 0
    for _ in range(2000):
        observed = rng.gamma(shape, truth / shape, size=(2, n_states))
        price = (observed.sum(axis=0) + truth) / 3
        budget = float(np.dot(counts, price)) + spend_margin(counts, price, cv, sds=2.0,
                                                             price_observations=np.full(n_states, 2))
        spend = rng.gamma(shape, np.repeat(truth, counts) / shape).sum()
        overspent += spend > budget
    assert overspent / 2000 < 0.05


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 100_000), st.integers(0, 5_000),
       st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=6).filter(lambda w: sum(w) > 0))
def test_split_parts_add_up_to_what_is_left_and_absorb_restores_the_charges(budget, spent, weights):
    # The shards of a stage (tasks/fanout.py) together can spend exactly what the stage's ledger had left.
    ledger = BudgetLedger(budget + spent)
    ledger.charge("main", spent)
    parts = ledger.split(weights)
    assert [p.budget >= 0 for p in parts] == [True] * len(weights)
    assert sum(p.budget for p in parts) == ledger.remaining == budget
    for k, (part, weight) in enumerate(zip(parts, weights, strict=True)):
        assert abs(part.budget - budget * weight / sum(weights)) <= 1  # proportional, up to rounding
        part.charge("branch", part.budget // 2, round_idx=k % 2)
        part.charge("summary", part.remaining // 3, round_idx=k % 2)
    for part in parts:
        ledger.absorb(part)
    assert ledger.spent == spent + sum(p.spent for p in parts)
    assert ledger.by_kind["branch"] == sum(p.by_kind["branch"] for p in parts)


def test_split_worked_example_and_bad_weights():
    ledger = BudgetLedger(10)
    assert [p.budget for p in ledger.split([1, 1, 1])] == [3, 4, 3]
    with pytest.raises(ValueError, match="weights"):
        ledger.split([0, 0])
