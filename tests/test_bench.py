"""The benchmarks run end to end on a tiny grid and write the JSON the README documents."""

import json

from bench import critic_budget
from flows.cli import main as focus_main

REQUIRED_KEYS = {"env", "strategy", "budget_ratio", "seed_count", "critic_mse_mean", "critic_mse_se",
                 "adv_mse_mean", "sign_acc_mean"}


def test_critic_budget_tiny_grid_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "cb.json", tmp_path / "cb.png"
    code = focus_main(["bench", "critic-budget", "--seeds", "2", "--envs", "combination_lock", "lookup_chain",
                       "--strategies", "uniform_random", "ivr_greedy", "oracle", "--budget-ratios", "0.5",
                       "--main-trajectories", "12", "--rounds", "2", "--workers", "1",
                       "--json", str(out), "--plot", str(png)])
    assert code == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert {(r["env"], r["strategy"]) for r in results} >= {("combination_lock", "ivr_greedy"),
                                                            ("lookup_chain", "none")}
    for r in results:
        assert set(r) >= REQUIRED_KEYS
        assert r["seed_count"] == 2
        assert 0.0 <= r["sign_acc_mean"] <= 1.0 and r["critic_mse_mean"] >= 0.0
    for row in report["rows"]:
        assert row["spent_tokens"] <= row["budget_ratio"] * row["main_tokens"] + 1e-9
        if row["budget_ratio"] > 0:
            assert row["spent_tokens"] > 0
    assert png.stat().st_size > 10_000


def test_same_seed_same_rows():
    settings = critic_budget.Settings(main_trajectories=10, rounds=1)
    a = critic_budget.run_seed("lookup_chain", 3, [0.5], ["ivr_greedy"], settings)
    b = critic_budget.run_seed("lookup_chain", 3, [0.5], ["ivr_greedy"], settings)
    strip = [{k: v for k, v in row.items() if k != "seconds"} for row in a]
    assert strip == [{k: v for k, v in row.items() if k != "seconds"} for row in b]


def test_envs_benchmark_reports_expert_and_random(tmp_path):
    out = tmp_path / "envs.json"
    assert focus_main(["bench", "envs", "--envs", "deep_search", "--episodes", "8", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["expert_success"] == 1.0 and row["random_success"] <= 0.25
    assert row["train_tasks"] >= 500 and row["heldout_tasks"] >= 100
    assert 6 <= row["median_turns"] <= 20


def test_sft_warmstart_bench_writes_its_figures(tmp_path):
    out = tmp_path / "sft.json"
    code = focus_main(["bench", "sft", "--envs", "legal", "--seconds", "2", "--demonstrations", "4",
                       "--episodes", "2", "--json", str(out)])
    assert code == 0
    [row] = json.loads(out.read_text())["results"]
    assert row["env"] == "legal" and row["sft_steps"] >= 1
    assert 0.0 <= row["heldout_success"] <= 1.0 and 0.0 <= row["train_success"] <= 1.0
