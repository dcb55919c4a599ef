"""The benchmarks run end to end on a tiny grid and write the JSON that docs/benchmarks.md documents."""

import json
from pathlib import Path

import numpy as np
import pytest

from bench import critic_budget
from flows.cli import main as focus_main
from focus_core.config import AcquisitionConfig

REQUIRED_KEYS = {"env", "strategy", "budget_ratio", "seed_count", "critic_mse_mean", "critic_mse_se",
                 "adv_mse_mean", "sign_acc_mean", "critic_mse_ratio", "oracle_gap_captured",
                 "oracle_gap_captured_se", "spearman", "spearman_se"}


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
        if row["strategy"] in ("ivr_greedy", "oracle"):
            assert -1.0 <= row["spearman"] <= 1.0  # their scores rank the critic's actual error
        else:
            assert row["spearman"] is None  # uniform_random wants every state alike; no branches at budget 0
    assert report["default_strategy"] == AcquisitionConfig().strategy
    cells = {(r["env"], r["strategy"]): r for r in results}
    assert cells[("lookup_chain", "uniform_random")]["critic_mse_ratio"] == pytest.approx(1.0)
    assert cells[("lookup_chain", "uniform_random")]["oracle_gap_captured"] == pytest.approx(0.0)
    assert cells[("lookup_chain", "oracle")]["oracle_gap_captured"] == pytest.approx(1.0)
    assert png.stat().st_size > 10_000


def _start_method() -> str:
    import multiprocessing

    return multiprocessing.get_start_method()


def test_bench_workers_are_fresh_processes_not_forks():
    """A forked worker inherits the locks of threads that do not exist in it (torch's, Prefect's, xdist's): seen, a
    forked critic-budget worker segfaulted in the garbage collector under CI. The benches' pools spawn."""
    import bench.critic_agent
    from bench import process_pool

    with process_pool(1) as pool:
        assert pool.submit(_start_method).result() == "spawn"
    for module in (critic_budget, bench.critic_agent):
        assert "ProcessPoolExecutor(" not in Path(module.__file__).read_text(), module.__name__


def test_oracle_gap_captured_worked_example():
    """Seeds' MSE: uniform U, oracle O, strategy S. D = U − S = (6, 1, 5)e-3, G = U − O = (10, 4, 10)e-3, so
    R = mean D / mean G = 4 / 8 = 0.5; D − R·G = (1, −1, 0)e-3 has sd 1e-3, so se = 1e-3 / √3 / 8e-3 = 0.0722."""
    uniform, oracle, strategy = [0.030, 0.020, 0.025], [0.020, 0.016, 0.015], [0.024, 0.019, 0.020]
    gap, se = critic_budget.gap_captured(np.array(uniform), np.array(strategy), np.array(oracle))
    assert gap == pytest.approx(0.5) and se == pytest.approx(1e-3 / np.sqrt(3) / 8e-3)
    rows = [{"env": "e", "strategy": name, "budget_ratio": 1.0, "seed": seed, "critic_mse": mse, "adv_mse": 0.0,
             "sign_acc": 1.0, "spearman": rho}
            for name, values, rho in (("uniform_random", uniform, None), ("oracle", oracle, 0.5), ("x", strategy, 0.2))
            for seed, mse in enumerate(values)]
    cell = {r["strategy"]: r for r in critic_budget.summarise(rows)}["x"]
    assert cell["oracle_gap_captured"] == pytest.approx(0.5) and cell["oracle_gap_captured_se"] == pytest.approx(se)
    assert cell["critic_mse_ratio"] == pytest.approx(0.021 / 0.025)
    assert cell["spearman"] == pytest.approx(0.2) and cell["spearman_se"] == pytest.approx(0.0, abs=1e-12)


def test_quick_grid_covers_the_operating_point_and_the_default():
    assert {1.0, 2.0} <= set(critic_budget.QUICK_GRID["budget_ratios"])
    assert {0.25, 0.5, 1.0, 2.0, 4.0} <= set(critic_budget.FULL_GRID["budget_ratios"])
    assert {"uniform_random", "oracle", AcquisitionConfig().strategy} <= set(critic_budget.QUICK_GRID["strategies"])


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


def test_trap_methods_summary_pairs_seeds_and_renders_a_table():
    from bench.trap_methods import markdown, summarise

    def run(method, seed, finals):
        return {"env": "combination_lock", "method": method, "seed": seed,
                "curve": [{"iteration": i, "exact": v} for i, v in enumerate(finals)]}

    rows = [run("focus", 1, [0.2, 0.6]), run("focus", 2, [0.5, 0.9]),
            run("grpo", 1, [0.2, 0.5]), run("grpo", 2, [0.5, 0.6])]
    summary = {r["method"]: r for r in summarise(rows, ["focus", "grpo"])}
    assert summary["focus"]["final_exact"] == pytest.approx(0.75)
    assert summary["focus"]["final_exact_se"] == pytest.approx(np.std([0.6, 0.9], ddof=1) / np.sqrt(2))
    assert summary["focus"]["mean_exact_over_iterations"] == pytest.approx(np.mean([0.4, 0.7]))
    # Paired by seed: differences 0.1 and 0.3.
    assert summary["grpo"]["focus_minus_this"] == pytest.approx(0.2)
    assert summary["grpo"]["focus_minus_this_se"] == pytest.approx(np.std([0.1, 0.3], ddof=1) / np.sqrt(2))
    table = markdown(list(summary.values()))
    assert "| combination_lock | grpo | 2 | 0.550 ± 0.050 | 0.450 | +0.200 ± 0.100 |" in table


def test_every_registered_strategy_runs_in_the_critic_budget_bench():
    """Regression: the full grid (all strategies) failed at `entropy`, which the benchmark gave no entropies."""
    from focus_core.acquisition import STRATEGIES

    rows = critic_budget.run_seed("combination_lock", 0, [0.5], sorted(STRATEGIES),
                                  critic_budget.Settings(main_trajectories=8, rounds=1))
    assert {r["strategy"] for r in rows} == set(STRATEGIES) | {"none"}


def test_markdown_tables_render_every_cell_with_the_default_in_bold():
    rows = [{"env": "e", "strategy": s, "budget_ratio": x, "seed": seed, "critic_mse": mse + 0.01 * seed,
             "adv_mse": 0.0, "sign_acc": 1.0, "spearman": 0.3 if s == "ivr_greedy" else None}
            for seed in range(3) for x in (0.5, 1.0)
            for s, mse in (("uniform_random", 0.2), ("ivr_greedy", 0.15), ("oracle", 0.1))]
    text = critic_budget.markdown_tables(critic_budget.summarise(rows), default="ivr_greedy")
    assert "| **ivr_greedy** | 0.1600 ± 0.0058 (0.76); +0.50 ± 0.00; 0.30 |" in text
    assert text.count("| uniform_random |") == 1 and "×0.5 | ×1 |" in text


def test_ablation_pairs_by_seed_and_averages_over_envs():
    from bench import ablation

    rows = [{"env": env, "strategy": s, "budget_ratio": 1.0, "seed": seed, "critic_mse": mse * (1 + seed)}
            for env in ("a", "b") for seed in range(3)
            for s, mse in (("uniform_random", 0.2), ("ivr_greedy", 0.16), ("novelty", 0.14))]
    mean, se, n = ablation.paired_difference(rows, "novelty", "ivr_greedy", [1.0])
    assert (mean, n) == (pytest.approx(-0.1), 6) and se == pytest.approx(0.0, abs=1e-12)
    summary = critic_budget.summarise([{**r, "adv_mse": 0.0, "sign_acc": 1.0, "spearman": None} for r in rows])
    cell = ablation.cells(summary, [1.0])[("novelty", 1.0)]
    assert cell["ratio"] == pytest.approx(0.7) and cell["worst"] == pytest.approx(0.7)


def test_critic_budget_takes_tuning_seeds_and_the_prior_function_critic(tmp_path):
    """--first-seed moves the seeds (settings are tuned on 100.., reported on 0..); --critic-members and
    --critic-prior-scale give every strategy the same other critic, and the JSON says which it was."""
    def run(scale: str) -> dict:
        out = tmp_path / f"cb{scale}.json"
        code = focus_main(["bench", "critic-budget", "--seeds", "1", "--first-seed", "100", "--envs",
                           "combination_lock", "--strategies", "uniform_random", "ensemble_std", "--budget-ratios",
                           "0.5", "--main-trajectories", "12", "--rounds", "2", "--workers", "1",
                           "--critic-members", "8", "--critic-prior-scale", scale, "--json", str(out)])
        assert code == 0
        return json.loads(out.read_text())

    prior, plain = run("1.0"), run("0")
    assert {row["seed"] for row in prior["rows"]} == {100}
    assert (prior["first_seed"], prior["critic_members"], prior["critic_prior_scale"]) == (100, 8, 1.0)
    assert all(-1.0 <= row["spearman"] <= 1.0 for row in prior["rows"] if row["strategy"] == "ensemble_std")
    # same seed and main trajectories, another critic: the round-0 critic (budget 0) already differs
    [prior_start] = [r["critic_mse"] for r in prior["rows"] if r["budget_ratio"] == 0]
    [plain_start] = [r["critic_mse"] for r in plain["rows"] if r["budget_ratio"] == 0]
    assert prior_start != plain_start


def test_critic_diversity_summary_pairs_critics_by_seed():
    from bench.critic_diversity import markdown, summary

    def report(members, scale, uniform_mse, ensemble_mse, seeds=(100, 101)):
        rows = [{"env": "combination_lock", "budget_ratio": 1.0, "seed": s, "strategy": strategy, "critic_mse": mse,
                 "spearman": rho} for s in seeds for strategy, mse, rho in
                (("uniform_random", uniform_mse, None), ("ensemble_std", ensemble_mse, 0.3))]
        return {"rows": rows, "critic_members": members, "critic_prior_scale": scale}

    rows = summary([report(5, 0.0, 0.02, 0.03), report(16, 1.0, 0.01, 0.005)])
    assert [r["uniform_vs_reference"] for r in rows] == [1.0, 0.5]
    assert [r["ensemble_std_vs_uniform"] for r in rows] == [1.5, 0.5]
    assert rows[1]["ensemble_std_spearman"] == pytest.approx(0.3)
    assert "| 16 members, prior scale 1 | 0.50 | 0.50; +0.30 |" in markdown(rows)
    with pytest.raises(ValueError, match="share their seeds"):
        summary([report(5, 0.0, 0.02, 0.03), report(16, 1.0, 0.01, 0.005, seeds=(0, 1))])


def test_value_calibration_names_a_missing_comparison_or_row_in_one_line(tmp_path, capsys):
    from bench import value_calibration
    from flows.compare import load_spec, write_record
    from focus_core.artifacts import ArtifactStore

    store = tmp_path / "runs"
    with pytest.raises(ValueError, match="no comparison 'headroom'.*fix: run `focus compare"):
        value_calibration.main(["headroom", "--store", str(store)])
    write_record(ArtifactStore(store), load_spec(Path(__file__).parents[1] / "configs/compare/headroom_step.yaml"))
    with pytest.raises(SystemExit):
        value_calibration.main(["headroom_step", "--store", str(store), "--method", "focus_calibrated_prior"])
    assert "headroom_step has no focus_calibrated_prior row (fix: --method" in capsys.readouterr().err


def test_pooled_reports_hold_every_seed_of_the_shared_rows_once_and_report_over_all_of_them(tmp_path):
    from bench.pool_reports import pool
    from flows.report import summarise

    first = json.loads(Path("docs/results/horizon_chain/horizon_chain.json").read_text())
    later = json.loads(json.dumps(first).replace('"seed": 10', '"seed": 20').replace("seed=10", "seed=20"))
    later["name"] = "later"
    later["runs"] = [r for r in later["runs"] if r["method"] in ("focus", "grpo")]
    pooled = pool([first, later], "both")
    assert {r["method"] for r in pooled["runs"]} == {"focus", "grpo"}  # the rows both have
    assert sorted({r["seed"] for r in pooled["runs"]}) == [101, 102, 103, 201, 202, 203]
    table = {row["method"]: row for row in summarise(pooled)["table"]}
    assert table["grpo"]["seeds"] == 6
    finals = [max((r for r in pooled["iterations"] if r["method"] == "grpo" and r["seed"] == s),
                  key=lambda r: r["iteration"])["heldout_success_exact"] for s in (101, 102, 103, 201, 202, 203)]
    assert table["grpo"]["final"] == pytest.approx(np.mean(finals))
    with pytest.raises(ValueError, match="count twice"):
        pool([first, first], "twice")
    other = json.loads(json.dumps(later).replace("hops=5", "hops=4"))
    with pytest.raises(ValueError, match="other settings"):
        pool([first, other], "mixed")
