"""The trap environments as pipeline environments, and the exact held-out value of an LM policy on them.

Fast tests: the tool protocol (off-menu messages are feedback), the Markov context (the harness's contexts are a
function of the state, and they are the ids the exact evaluator scores), the batched scorer against ``score``,
and the recursion against the trap's own exact values for a policy given as a table. Slow tests: a tiny
SFT-warm-started policy's exact value against 2,000 sampled episodes and its action distribution at one state
against sampling frequencies, and one iteration of ``focus train`` on each trap environment.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from focus_core.agent.harness import AgentRunner, SegmentStart
from focus_core.agent.scripted import ScriptedActor
from focus_core.agent.sft import warm_start
from focus_core.config import AgentConfig, BootstrapConfig, ModelConfig
from focus_core.envs import make_env
from focus_core.envs.trap_tools import (
    HELDOUT_SEED_START,
    OFF_MENU,
    CombinationLockEnv,
    ExactEvaluator,
    LookupChainEnv,
    TrapToolEnv,
    choose_message,
)
from focus_core.envs.traps import CLUE_FAMILIES, CombinationLock, LookupState, TabularPolicy
from focus_core.policy.base import Generation
from focus_core.policy.models import tiny_policy
from focus_core.policy.tokenizer import END, train_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

MARKOV = AgentConfig(compression="observation", max_turns=12, max_action_tokens=12)
TRAPS = ("combination_lock", "lookup_chain")


def corpus_tokenizer(env: TrapToolEnv):
    tasks = env.tasks("train")[:100]
    texts = [env.system_prompt(), OFF_MENU, *(t.prompt for t in tasks), *(env.first_observation(t) for t in tasks)]
    return train_tokenizer(texts + [choose_message(k) for k in range(1, 7)] * 20, vocab_size=400)


@pytest.fixture(scope="module", params=TRAPS)
def env(request) -> TrapToolEnv:
    return make_env(request.param)


class FixedActor:
    """Writes the given messages in order (one episode at a time), tokenized like the scripted expert."""

    def __init__(self, tokenizer, messages: list[str]):
        self.tokenizer, self.messages = tokenizer, list(messages)

    def generate(self, prompts, *, n=1, max_new_tokens, temperature=1.0, top_p=1.0, stop_token_ids=None, seed=0,
                 first_sample=None):
        assert len(prompts) == 1 and n == 1
        ids = self.tokenizer.encode(self.messages.pop(0), add_special_tokens=False)
        return [[Generation(ids + [self.tokenizer.convert_tokens_to_ids(END)], [0.0] * (len(ids) + 1), "stop")]]


def message_of(env: TrapToolEnv, task, state, kind: str) -> str:
    """The menu message of the lookup action of ``kind`` at ``state``."""
    trap = env.trap_of(task)
    return next(message for message, index in env.menu_messages(trap, state) if trap.action_kind(state, index) == kind)


def after(env: TrapToolEnv, task, state, kind: str):
    """The lookup state after the action of ``kind``."""
    trap = env.trap_of(task)
    return env.transition(trap, state, env.action_of(trap, state, message_of(env, task, state, kind)))[0]


# ---------------------------------------------------------------------------------------------- environments


def test_tasks_are_structure_seeds_with_disjoint_heldout_instances(env):
    train, heldout = env.tasks("train"), env.tasks("heldout")
    assert len(train) == 512 and len(heldout) == 128
    assert [t.facts["seed"] for t in train] == list(range(512))
    assert all(t.facts["seed"] >= HELDOUT_SEED_START for t in heldout)
    assert not {t.split_key for t in train} & {t.split_key for t in heldout}
    assert len({t.task_id for t in train + heldout}) == 640
    assert env.tasks("train") == make_env(env.name).tasks("train")  # deterministic


def test_the_lock_clue_rule_is_the_same_for_every_seed():
    families = {word: symbol for symbol, words in enumerate(CLUE_FAMILIES) for word in words}
    for seed in (0, 1, 2, HELDOUT_SEED_START):
        lock = CombinationLock(horizon=6, n_symbols=3, delay=2, seed=seed, clues=True)
        assert lock.combination == tuple(families[word] for word in lock.clues)
        state = lock.live_state(2)
        assert f"Dial 3 shows {lock.clues[2]}." in lock.observation(state)
    assert CombinationLock(seed=4).combination == CombinationLock(seed=4, clues=False).combination  # default kept


def test_expert_solves_every_task_and_recovers_from_mistakes(env):
    for task in env.tasks("heldout")[:32]:
        env.reset(task)
        history = [("sixth()", env.step("sixth()")[0])]  # an off-menu message first
        for _ in range(20):
            action = env.expert_action(task, history)
            observation, reward, done, _ = env.step(action)
            history.append((action, observation))
            if done:
                break
        assert done and reward == 1.0, task.task_id


@pytest.mark.parametrize("message", ["", "first( )", "first() ", "First()", "first", "sixth()", "seventh()",
                                     "choose(n=1)", '<tool_call>{"name": "first", "arguments": {}}</tool_call>',
                                     "set dial 1 to A", "first()\nsecond()", "x" * 5000, None])
def test_off_menu_messages_are_feedback_and_change_nothing(env, message):
    task = env.tasks("heldout")[0]
    env.reset(task)
    trap = env.trap_of(task)
    start = trap.initial_state()
    observation, reward, done, info = env.step(message)
    assert observation == f"{env.render(trap, start)}\n{OFF_MENU}"
    assert (reward, done) == (0.0, False) and "error" in info
    # The state is unchanged: a listed call now does what it would have done first.
    stepped, _, _, _ = env.step(choose_message(1))
    fresh = make_env(env.name)
    fresh.reset(task)
    assert stepped == fresh.step(choose_message(1))[0]


def test_after_the_end_every_message_is_an_error(env):
    task = env.tasks("train")[0]
    env.reset(task)
    done, history = False, []
    while not done:
        action = env.expert_action(task, history)
        observation, _, done, _ = env.step(action)
        history.append((action, observation))
    observation, reward, done, _ = env.step(choose_message(1))
    assert observation.startswith("Error:") and reward == 0.0


def test_trap_options_the_protocol_cannot_serve_are_refused():
    with pytest.raises(ValueError, match="noise must be 0"):
        LookupChainEnv(noise=0.1)
    with pytest.raises(ValueError, match="clues"):
        CombinationLockEnv(clues=False)
    with pytest.raises(ValueError, match="unknown option"):
        CombinationLockEnv(dials=4)


# ------------------------------------------------------------------------------------------- Markov context


def test_two_paths_to_one_state_give_identical_contexts_and_those_the_evaluator_scores():
    env = make_env("lookup_chain")
    task = env.tasks("heldout")[3]
    trap = env.trap_of(task)
    tokenizer = corpus_tokenizer(env)
    s0 = trap.initial_state()
    found, off_topic = after(env, task, s0, "advance"), after(env, task, s0, "detour")
    irrelevant = after(env, task, found, "detour")
    paths = {
        "search, detour read, read": [message_of(env, task, s0, "advance"), message_of(env, task, found, "detour"),
                                      message_of(env, task, irrelevant, "advance")],
        "detour search, search, read": [message_of(env, task, s0, "detour"),
                                        message_of(env, task, off_topic, "advance"),
                                        message_of(env, task, found, "advance")],
        "off-menu first": ["sixth()", message_of(env, task, s0, "advance"),
                           message_of(env, task, found, "detour"), message_of(env, task, irrelevant, "advance")],
    }
    contexts = {}
    for name, messages in paths.items():
        runner = AgentRunner(FixedActor(tokenizer, [*messages, "sixth()"]), lambda: make_env("lookup_chain"),
                             MARKOV.model_copy(update={"max_turns": len(messages) + 1}))
        episode = runner.run([task])[0]
        assert len(episode.starts) == len(messages) + 1  # every turn starts a segment
        contexts[name] = episode.starts[len(messages)].context_ids
        assert env.replay(task, messages) == LookupState(hop=1, phase="search", turn=3, poisoned=False, last="noted")
    assert len(set(contexts.values())) == 1
    evaluator = ExactEvaluator(tiny_policy(tokenizer, layers=1, hidden=16, heads=2, intermediate=16), env, MARKOV)
    state = env.replay(task, paths["search, detour read, read"])
    assert evaluator.context_ids(task, state, False) == contexts["off-menu first"]
    # The first context, and the one right after an off-menu message, are the evaluator's too.
    runner = AgentRunner(FixedActor(tokenizer, ["sixth()", "sixth()"]), lambda: make_env("lookup_chain"),
                         MARKOV.model_copy(update={"max_turns": 2}))
    episode = runner.run([task])[0]
    assert episode.starts[0].context_ids == evaluator.context_ids(task, s0, False)
    assert episode.starts[1].context_ids == evaluator.context_ids(task, s0, True)


def test_markov_mode_restarts_the_context_after_every_turn_and_other_modes_are_unchanged(env):
    tokenizer = corpus_tokenizer(env)
    task = env.tasks("train")[0]
    expert = ScriptedActor(tokenizer, tokenizer.convert_tokens_to_ids(END))
    markov = AgentRunner(expert, lambda: make_env(env.name), MARKOV).run([task])[0]
    assert markov.reward == 1.0 and len(markov.starts) == markov.n_tool_calls
    for start in markov.starts:
        assert len(start.messages) == 2 and start.messages[1]["content"].startswith(task.prompt + "\n")
    notes = AgentRunner(expert, lambda: make_env(env.name), AgentConfig(compress_every_turns=4)).run([task])[0]
    assert notes.reward == 1.0 and len(notes.starts) == math.ceil(notes.n_tool_calls / 4)
    # The first context shows the opening observation after the prompt in every mode.
    assert notes.starts[0].messages[1]["content"] == f"{task.prompt}\n{env.first_observation(task)}"


# ---------------------------------------------------------------------------------------------- exact values


def test_score_batch_equals_score_at_any_temperature():
    tokenizer = train_tokenizer(["choose(n=1) choose(n=2) Lock: dial shows rain ember stone"] * 10, vocab_size=300)
    policy = tiny_policy(tokenizer, layers=2, hidden=32, heads=2, intermediate=64, max_context=512)
    rng = np.random.default_rng(0)
    shared = rng.integers(6, len(tokenizer), size=40).tolist()
    prompts = [shared[: int(rng.integers(0, 40))]
               + rng.integers(6, len(tokenizer), size=int(rng.integers(1, 30))).tolist() for _ in range(30)]
    prompts += [list(prompts[0]), prompts[1][:3]]  # a repeated prompt, and a prefix of another
    completions = [[rng.integers(0, len(tokenizer), size=int(rng.integers(1, 5))).tolist()
                    for _ in range(int(rng.integers(0, 5)))] for _ in prompts]
    for temperature, memory in ((1.0, 1 << 30), (0.6, 20_000)):
        batched = policy.score_batch(prompts, completions, temperature=temperature, memory_bytes=memory)
        for prompt, options, got in zip(prompts, completions, batched, strict=True):
            for completion, row in zip(options, got, strict=True):
                np.testing.assert_allclose(row, policy.score(prompt, completion, temperature=temperature), atol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        policy.score([1, 2], [3], temperature=0.0)


class TablePolicy:
    """A stand-in policy whose distribution over the listed actions is given by position: ``table[menu size]``;
    the rest of the mass is off-menu. Only what the exact evaluator calls."""

    def __init__(self, tokenizer, table: dict[int, list[float]]):
        self.tokenizer, self.table, self.max_context = tokenizer, table, 4096
        self.stops = len(AgentRunner(self, lambda: None, MARKOV).stop_ids)

    def score_batch(self, prompts, completions, *, temperature=1.0):
        out = []
        for options in completions:
            menu = self.table[len(options) // self.stops]
            out.append([[math.log(menu[k // self.stops] / self.stops)] + [0.0] * (len(c) - 1)
                        for k, c in enumerate(options)])
        return out


@pytest.mark.parametrize("name", TRAPS)
def test_the_recursion_equals_the_traps_own_exact_values_for_a_table_policy(name):
    env = make_env(name)
    table = {2: [0.3, 0.7], 3: [0.2, 0.5, 0.3], 4: [0.1, 0.4, 0.3, 0.2]}
    policy = TablePolicy(corpus_tokenizer(env), table)
    tasks = env.tasks("heldout")[:6]
    long = MARKOV.model_copy(update={"max_turns": 60})
    exact = ExactEvaluator(policy, env, long).evaluate(tasks)
    for task, value in zip(tasks, exact.values, strict=True):
        trap = env.trap_of(task)
        positions = lambda state, trap=trap: env.display_order(trap, state)  # noqa: E731
        tabular = TabularPolicy(trap, lambda state, positions=positions: np.array(
            table[len(positions(state))])[np.argsort(positions(state))])
        assert value == pytest.approx(trap.exact_values(tabular, [trap.initial_state()])[0], abs=1e-12)
    # Off-menu mass only repeats the state when turns are unlimited: the same values as the renormalised table.
    leaky = TablePolicy(policy.tokenizer, {size: [0.8 * p for p in row] for size, row in table.items()})
    assert ExactEvaluator(leaky, env, long).evaluate(tasks).values == pytest.approx(exact.values, abs=1e-9)
    # With the harness's turn limit it costs value, and a limit below the shortest solution leaves none.
    assert np.all(ExactEvaluator(leaky, env, MARKOV).evaluate(tasks).values < exact.values)
    short = MARKOV.model_copy(update={"max_turns": 5})
    assert np.all(ExactEvaluator(leaky, env, short).evaluate(tasks).values == 0.0)


@pytest.mark.parametrize("name", TRAPS)
def test_values_at_the_states_of_played_episodes_equal_the_traps_own_exact_values(name):
    """``values_at`` (what ``exact_values`` puts in place of V̂): replay the messages, recurse from there."""
    env = make_env(name)
    table = {2: [0.3, 0.7], 3: [0.2, 0.5, 0.3], 4: [0.1, 0.4, 0.3, 0.2]}
    long = MARKOV.model_copy(update={"max_turns": 60})
    evaluator = ExactEvaluator(TablePolicy(corpus_tokenizer(env), table), env, long)
    tasks, rng, points = env.tasks("train")[:8], np.random.default_rng(0), []
    for task in tasks:  # episodes of random menu picks, every state on the way
        trap, messages = env.trap_of(task), []
        state = trap.initial_state()
        while not trap.is_terminal(state):
            points.append((task, tuple(messages), len(messages)))
            message, index = env.menu_messages(trap, state)[rng.integers(len(trap.action_menu(state)))]
            messages.append(message)
            state = env.transition(trap, state, index)[0]
    values = evaluator.values_at(points)
    assert values[[calls == () for _, calls, _ in points]] == pytest.approx(evaluator.evaluate(tasks).values, abs=1e-12)
    for (task, messages, _), value in zip(points, values, strict=True):
        trap = env.trap_of(task)
        positions = lambda state, trap=trap: env.display_order(trap, state)  # noqa: E731
        tabular = TabularPolicy(trap, lambda state, positions=positions: np.array(
            table[len(positions(state))])[np.argsort(positions(state))])
        assert value == pytest.approx(trap.exact_values(tabular, [env.replay(task, messages)])[0], abs=1e-12)
    assert values.max() > 0.0 and (name != "combination_lock" or values.min() == 0.0)  # random picks doom locks


def test_values_at_count_the_turns_taken_and_the_off_menu_flag():
    env = make_env("combination_lock")
    leaky = TablePolicy(corpus_tokenizer(env), {3: [0.2, 0.5, 0.1]})  # 0.2 off-menu
    evaluator = ExactEvaluator(leaky, env, MARKOV)  # 12 turns for 6 dials
    task = env.tasks("train")[0]
    off = "seventh()"
    fresh, later, after_off, too_late = evaluator.values_at(
        [(task, (), 0), (task, (), 3), (task, (off,), 1), (task, (), MARKOV.max_turns - 5)])
    assert fresh > later > 0.0 and too_late == 0.0  # fewer turns left, less value; 6 dials need 6 turns
    assert after_off == pytest.approx(evaluator.values_at([(task, (), 1)])[0])  # the table ignores the flag
    assert env.position(task, (off,)) == (env.trap_of(task).initial_state(), True)
    trap = env.trap_of(task)
    wrong = next(m for m, i in env.menu_messages(trap, trap.initial_state()) if i != trap.combination[0])
    assert evaluator.values_at([(task, (wrong,), 1)])[0] == 0.0  # a doomed lock


def test_exact_evaluation_refuses_settings_it_cannot_model():
    env = make_env("combination_lock")
    policy = TablePolicy(corpus_tokenizer(env), {3: [0.2, 0.5, 0.3]})
    with pytest.raises(ValueError, match="compression=observation"):
        ExactEvaluator(policy, env, AgentConfig())
    with pytest.raises(ValueError, match="top_p"):
        ExactEvaluator(policy, env, MARKOV.model_copy(update={"top_p": 0.9}))
    with pytest.raises(ValueError, match="max_action_tokens"):
        ExactEvaluator(policy, env, MARKOV.model_copy(update={"max_action_tokens": 2})).evaluate(
            env.tasks("heldout")[:1])


# ------------------------------------------------------------------ the LM policy: exact against sampled (slow)


@pytest.fixture(scope="module")
def lookup_policy():
    """A 1-layer tiny model after 600 SFT steps on lookup-chain demonstrations (about 30 s on one core)."""
    env = make_env("lookup_chain")
    model = ModelConfig(layers=1, hidden=32, heads=2, intermediate=64, vocab_size=400, max_context=1024)
    bootstrap = BootstrapConfig(demonstrations=300, max_steps=600, max_seconds=3600, batch_tokens=2048, lr=1e-3)
    policy, _ = warm_start(lambda: make_env("lookup_chain"), env.tasks("train"), MARKOV, model, bootstrap, seed=0)
    return policy


def accepted_non_canonical(env: TrapToolEnv, episodes, policy, stop_ids) -> tuple[int, int]:
    """(accepted messages whose ids are not the canonical ones, accepted messages) over ``episodes``."""
    odd = accepted = 0
    for episode in episodes:
        messages: list[str] = []
        for turn in episode.turns:
            if turn.role != "policy":
                continue
            trap, state = env.trap_of(episode.task), env.replay(episode.task, messages)
            if env.action_of(trap, state, turn.text) is not None:
                accepted += 1
                canonical = policy.tokenizer.encode(turn.text, add_special_tokens=False)
                odd += not (turn.token_ids[:-1] == canonical and turn.token_ids[-1] in stop_ids)
            messages.append(turn.text)
    return odd, accepted


@pytest.mark.slow
def test_exact_value_of_the_lm_policy_agrees_with_2000_sampled_episodes(lookup_policy, capsys):
    env = make_env("lookup_chain")
    agent = MARKOV.model_copy(update={"max_turns": 9, "temperature": 0.8})  # the turn limit binds: 7 turns at best
    candidates = env.tasks("heldout")[:32]
    values = ExactEvaluator(lookup_policy, env, agent).evaluate(candidates).values
    tasks = [candidates[i] for i in np.argsort(-values, kind="stable")[:8]]  # tasks with something to win
    exact = ExactEvaluator(lookup_policy, env, agent).evaluate(tasks)
    runner = AgentRunner(lookup_policy, lambda: make_env("lookup_chain"), agent)
    episodes = []
    for wave in range(5):  # 5 x 400 episodes, 250 per task
        episodes += runner.run([tasks[k % len(tasks)] for k in range(400)], seed=wave)
    rewards = np.array([e.reward for e in episodes]).reshape(-1, len(tasks))  # [episode, task]
    sampled, n = rewards.mean(axis=0), rewards.shape[0]
    se = math.sqrt(float(np.sum(exact.values * (1 - exact.values))) / n) / len(tasks)
    assert abs(sampled.mean() - exact.values.mean()) <= 3 * se, (sampled.mean(), exact.values.mean(), se)
    per_task_se = np.sqrt(np.maximum(exact.values * (1 - exact.values), 1e-4) / n)
    assert np.all(np.abs(sampled - exact.values) <= 4 * per_task_se)
    assert 0.05 < exact.values.mean() < 0.95 and exact.off_menu_mass > 0.0  # a policy worth checking
    odd, accepted = accepted_non_canonical(env, episodes, lookup_policy, runner.stop_ids)
    with capsys.disabled():
        print(f"\nexact {exact.values.mean():.4f} sampled {sampled.mean():.4f} (se {se:.4f}); {exact.contexts} "
              f"contexts scored in {exact.score_seconds:.2f} s; non-canonical accepted messages {odd} of {accepted}")
    assert odd <= 0.01 * accepted


@pytest.mark.slow
def test_menu_probabilities_and_off_menu_mass_match_sampling_frequencies_at_one_state(lookup_policy):
    env = make_env("lookup_chain")
    task = env.tasks("heldout")[0]
    tokenizer = lookup_policy.tokenizer
    expert = ScriptedActor(tokenizer, tokenizer.convert_tokens_to_ids(END))
    played = AgentRunner(expert, lambda: make_env("lookup_chain"), MARKOV).run([task])[0]
    start: SegmentStart = played.starts[3]  # hop 2's read: the delayed trap's menu of four
    trap, state = env.trap_of(task), env.replay(task, list(start.calls))
    assert len(env.menu_messages(trap, state)) == 4
    evaluator = ExactEvaluator(lookup_policy, env, MARKOV)
    p = evaluator.action_probabilities([(task, state, False)])[0]
    off = 1.0 - p.sum()
    assert np.all(p >= 0) and p.sum() <= 1 + 1e-9
    single_turn = MARKOV.model_copy(update={"max_turns": start.turn_idx + 1})
    samples = AgentRunner(lookup_policy, lambda: make_env("lookup_chain"), single_turn).run(
        starts=[start] * 4000, seed=7)
    first = [next(t.text for t in e.turns if t.role == "policy") for e in samples]
    messages = [message for message, _ in env.menu_messages(trap, state)]
    frequencies = np.array([sum(text == m for text in first) for m in messages]) / len(first)
    for probability, frequency in zip([*p, off], [*frequencies, 1 - frequencies.sum()], strict=True):
        assert abs(frequency - probability) <= 4 * math.sqrt(max(probability * (1 - probability), 1e-4) / len(first))


# ------------------------------------------------------------------------------------ focus train end to end


TRAP_CONFIG = """
method: focus
seed: 3
iterations: 1
env: {{name: {env}, eval_tasks: 6, options: {{train_tasks: 48, heldout_tasks: 16}}}}
model: {{layers: 1, hidden: 32, heads: 2, intermediate: 64, vocab_size: 400}}
bootstrap: {{demonstrations: 24, epochs: 1, max_seconds: 10000}}
agent: {{compression: observation, max_turns: 12, max_action_tokens: 12}}
budget: {{prompts_per_iteration: 2, group_size_grpo: 4, group_size_main: 2, measure_episodes: 8}}
ppo: {{lr: 1.0e-4, epochs: 1}}
acquisition: {{rounds: 1, chunk_size: 1}}
critic: {{steps: 10, hidden: 16}}
"""


# The lookup chain's run also takes the critic off its default size: 16 members (5 by default, the lead of
# docs/benchmarks.md's ensemble item), and a second acquisition round, so that a plan reads a fitted critic's spread.
SIXTEEN_MEMBERS = {"acquisition: {rounds: 1, chunk_size: 1}": "acquisition: {rounds: 2, chunk_size: 1}",
                   "critic: {steps: 10, hidden: 16}": "critic: {steps: 10, hidden: 16, members: 16}"}


@pytest.mark.slow
@pytest.mark.usefixtures("on_prefect_server")
@pytest.mark.parametrize("name", TRAPS)
def test_one_iteration_of_focus_train_runs_end_to_end_with_exact_heldout_success(tmp_path: Path, name):
    from focus_core.artifacts import ArtifactStore
    from tests.test_pipeline import STAGES, focus, table_rows

    text = TRAP_CONFIG.format(env=name)
    for default, changed in SIXTEEN_MEMBERS.items() if name == "lookup_chain" else ():
        assert default in text
        text = text.replace(default, changed)
    config = tmp_path / "trap.yaml"
    config.write_text(text)
    focus("train", "--config", str(config), "--store", str(tmp_path / "runs"), "--run-id", "trap", cwd=tmp_path)
    store = ArtifactStore(tmp_path / "runs")
    assert store.run_info("trap")["status"] == "finished"
    committed = {f"{i}:{s}" for i, s, _ in store.committed("trap")}
    assert set(STAGES) <= committed
    for iteration in (0, 1):
        figures = store.manifest("trap", iteration, "evaluate").figures
        assert 0.0 <= figures["heldout_success_exact"] <= 1.0
        rows = store.read_table("trap", iteration, "evaluate", "evaluation").to_pylist()
        assert len(rows) == 6 and all(row["exact_value"] is not None for row in rows)
        assert figures["heldout_success_exact"] == pytest.approx(np.mean([row["exact_value"] for row in rows]))
    # The Markov context: every segment holds exactly one policy turn.
    turns = [r for r in table_rows(store, "trap", "rollouts") if r["role"] == "policy"]
    per_segment: dict[tuple, int] = {}
    for row in turns:
        key = (row["iteration"], row["episode_id"], row["segment_idx"])
        per_segment[key] = per_segment.get(key, 0) + 1
    assert per_segment and set(per_segment.values()) == {1}
    if name == "lookup_chain":
        _check_second_round_reads_the_sixteen_member_critic(store, "trap")


def _check_second_round_reads_the_sixteen_member_critic(store, run: str) -> None:
    """Round 1's plan shows, per state, the mean and spread of round 0's fitted critic: all 16 of its members."""
    from focus_core.critic import EnsembleCritic
    from tasks.inputs import CRITIC_FOLDER

    critic = EnsembleCritic.load(store.fetch_folder(run, 0, "fit_critic_r0", CRITIC_FOLDER))
    plan = store.read_table(run, 0, "acquire_r1", "acquisition").to_pylist()
    features = {r["state_id"]: r["features"] for r in store.read_table(run, 0, "segment", "states").to_pylist()}
    members = critic.predict_members(np.array([features[r["state_id"]] for r in plan], dtype=np.float32))
    assert members.shape == (16, len(plan)) and members.std(axis=0).max() > 0.0
    assert [r["critic_mean"] for r in plan] == pytest.approx(members.mean(axis=0).tolist(), abs=1e-6)
    assert [r["critic_std"] for r in plan] == pytest.approx(members.std(axis=0, ddof=1).tolist(), abs=1e-6)
    assert sum(r["continuations"] for r in plan) > 0


@pytest.mark.slow
@pytest.mark.usefixtures("on_prefect_server")
def test_exact_values_put_the_sampling_policys_exact_values_in_the_advantage_stage(tmp_path: Path, monkeypatch):
    """``exact_values: true`` (the perfect-critic diagnostic): the advantages' V is V^π of the policy that sampled."""
    from focus_core.artifacts import ArtifactStore
    from focus_core.policy.models import load_policy
    from tasks.inputs import POLICY_FOLDER
    from tests.test_pipeline import focus, table_rows

    config = tmp_path / "trap.yaml"
    # A warm start that plays the menus (about 0.5 held-out success), so that values are neither all 0 nor all 1.
    config.write_text(TRAP_CONFIG.format(env="combination_lock").replace(
        "bootstrap: {demonstrations: 24, epochs: 1, max_seconds: 10000}",
        "bootstrap: {demonstrations: 300, max_steps: 600, lr: 1.0e-3, batch_tokens: 2048, max_seconds: 10000}")
        + "exact_values: true\n")
    focus("train", "--config", str(config), "--store", str(tmp_path / "runs"), "--run-id", "exact", cwd=tmp_path)
    store = ArtifactStore(tmp_path / "runs")
    advantage_figures = store.manifest("exact", 0, "advantage").figures
    assert advantage_figures["estimated_value_error"] > 0.0 and advantage_figures["continuation_segments"] > 0
    advantages = {(r["episode_id"], r["segment_idx"]): r["value"] for r in table_rows(store, "exact", "advantages")}
    env = make_env("combination_lock", train_tasks=48, heldout_tasks=16)
    tasks = {t.task_id: t for t in env.tasks("train")}
    main = [r for r in table_rows(store, "exact", "episodes") if not r["is_branch"] and r["iteration"] == 0]
    # A main episode's first state: V^π(s_0) of its task, by evaluate()'s recursion from the initial state.
    policy = load_policy(store.fetch_folder("exact", 0, "bootstrap", POLICY_FOLDER))
    agent = MARKOV.model_copy(update={"max_action_tokens": 12})
    chosen = list({r["task_id"]: tasks[r["task_id"]] for r in main}.values())
    v0 = dict(zip([t.task_id for t in chosen], ExactEvaluator(policy, env, agent).evaluate(chosen).values, strict=True))
    for row in main:
        assert advantages[(row["episode_id"], 0)] == pytest.approx(v0[row["task_id"]], rel=1e-9, abs=1e-12)
    # A doomed lock is worth 0 whatever the policy (a live one too when too few turns are left to open it).
    calls: dict[str, list[str]] = {}
    doomed_states = 0
    for row in table_rows(store, "exact", "rollouts"):
        if row["iteration"] == 0 and row["branch_id"] is None:
            if row["role"] == "context":
                episode = next(e for e in main if e["episode_id"] == row["episode_id"])
                trap, task = env.trap_of(tasks[episode["task_id"]]), tasks[episode["task_id"]]
                doomed = trap.known_value(env.replay(task, calls.get(row["episode_id"], []))) == 0.0
                if doomed:
                    assert advantages[(row["episode_id"], row["segment_idx"])] == 0.0
                    doomed_states += 1
            elif row["role"] == "policy":
                calls.setdefault(row["episode_id"], []).append(row["text"])
    assert doomed_states and max(advantages.values()) > 0.0
    # bench.value_calibration reads the same run: its ensemble error is the stage's own figure over the main states.
    from bench.value_calibration import env_figures

    figures = env_figures(store, ["exact"])
    last_round = max((stage for _, stage, _ in store.committed("exact") if stage.startswith("fit_critic_r")),
                     key=lambda stage: int(stage.removeprefix("fit_critic_r")))  # by number: r10 after r9
    last = {(r["episode_id"], r["segment_idx"]): r["value"]
            for r in store.read_table("exact", 0, last_round, "values").to_pylist()}
    assert figures["all"]["states"] == len(last)
    assert figures["all"]["ensemble_mae"] == pytest.approx(np.mean([abs(v - advantages[k]) for k, v in last.items()]))
    assert 0.0 <= figures["all"]["calibrated_mae"] <= 1.0 and figures["scale_min"] >= 1.0
    # The stage again in this process, on the committed inputs of iteration 0: the same table, and the sampling
    # policy loaded once for the continuations' features and the exact values both (it was loaded twice).
    import tempfile

    import tasks.advantage
    from focus_core.config import validate_config
    from tasks.stage import RunContext

    ctx = RunContext(store, "exact", validate_config(store.run_info("exact")["config"]))
    rounds = sorted((stage for _, stage, _ in store.committed("exact") if stage.startswith("branch_r")),
                    key=lambda stage: int(stage.removeprefix("branch_r")))  # one iteration: all are iteration 0's
    branches = [store.manifest("exact", 0, stage) for stage in rounds]
    loads = []
    real_policy_at = tasks.advantage.policy_at
    monkeypatch.setattr(tasks.advantage, "policy_at", lambda *a: loads.append(a) or real_policy_at(*a))
    with tempfile.TemporaryDirectory() as scratch:
        again = tasks.advantage.compute(ctx, store.manifest("exact", 0, "segment"),
                                        store.manifest("exact", 0, last_round),
                                        store.manifest("exact", 0, "rollout"),
                                        store.manifest("exact", 0, "bootstrap"), Path(scratch), branches)
    assert len(loads) == 1
    assert again.tables["advantages"].to_pylist() == store.read_table("exact", 0, "advantage", "advantages").to_pylist()
    # exact_values_share: 0 keeps the fitted V̂ (its error measured), 0.5 lies halfway between V̂ and V^π at every
    # state, main and continuation alike, with half of V̂'s error.
    values = {}
    for share in (0.0, 0.5):
        config = validate_config(store.run_info("exact")["config"] | {"exact_values_share": share})
        with tempfile.TemporaryDirectory() as scratch:
            values[share] = tasks.advantage.compute(
                RunContext(store, "exact", config), store.manifest("exact", 0, "segment"),
                store.manifest("exact", 0, last_round), store.manifest("exact", 0, "rollout"),
                store.manifest("exact", 0, "bootstrap"), Path(scratch), branches)
    perfect = again.tables["advantages"].column("value").to_numpy()
    fitted, half = (values[share].tables["advantages"].column("value").to_numpy() for share in (0.0, 0.5))
    error = advantage_figures["estimated_value_error"]
    assert np.abs(fitted - perfect).mean() == pytest.approx(error)
    assert half == pytest.approx((fitted + perfect) / 2, abs=1e-12)
    assert values[0.0].figures["value_error"] == pytest.approx(error)
    assert values[0.5].figures["value_error"] == pytest.approx(error / 2)
    assert values[0.5].figures["estimated_value_error"] == pytest.approx(error)
    _check_continuation_states(store, "exact", branches, monkeypatch)


def _check_continuation_states(store, run: str, branches: list, monkeypatch) -> None:
    """``critic.continuation_states``: fit_critic also fits on every later state of every continuation the budget did
    not cut, with the continuation's return, cross-fitted: a fold's critic never sees its own fold's continuations."""
    import tempfile

    from focus_core.config import validate_config
    from focus_core.critic import EnsembleCritic
    from tasks import fit_critic
    from tasks.inputs import fold_critic_folder
    from tasks.stage import RunContext
    from tests.test_pipeline import table_rows

    config = validate_config(store.run_info(run)["config"] | {"critic": store.run_info(run)["config"]["critic"]
                                                                | {"continuation_states": True}})
    ctx, policy = RunContext(store, run, config), store.manifest(run, 0, "bootstrap")
    later = fit_critic.continuation_states(ctx, branches, policy)
    grown = [e for e in table_rows(store, run, "episodes") if e["is_branch"] and not e["budget_cut"]]
    assert len(later["returns"]) == sum(e["n_segments"] - 1 for e in grown) > 0  # all but the parent state
    reward = {e["episode_id"]: e["reward"] for e in grown}
    assert later["returns"].tolist() == [reward[e] for e in later["episode_ids"]]
    main_states = store.read_table(run, 0, "segment", "states")
    assert later["features"].shape == (len(later["returns"]), len(main_states.column("features")[0].as_py()))
    inputs = (ctx, 0, len(branches) - 1, store.manifest(run, 0, "segment"), store.manifest(run, 0, "rollout"),
              branches, [])
    # One continuation's return flipped: its own fold's critic is unchanged, the other folds' critics move.
    flipped = later["episode_ids"][0]
    main_tasks = store.read_table(run, 0, "rollout", "episodes").column("task_id").to_pylist()
    fold = fit_critic.return_folds(ctx, 0, [later["task_ids"][0]], [flipped], main_tasks)[0]
    probe = later["features"][:8]
    predictions = []
    for flip in (False, True):
        data = {**later, "returns": np.where([flip and e == flipped for e in later["episode_ids"]],
                                             1.0 - later["returns"], later["returns"])}
        monkeypatch.setattr(fit_critic, "continuation_states", lambda *_, data=data: data)
        with tempfile.TemporaryDirectory() as scratch:
            result = fit_critic.compute(*inputs, Path(scratch), policy)
            assert result.figures["continuation_states"] == len(later["returns"])
            predictions.append({k: EnsembleCritic.load(path).predict(probe)[0] for k, path in result.folders.items()
                                if k.startswith("critic_fold")})
    assert predictions[0][fold_critic_folder(int(fold))] == pytest.approx(predictions[1][fold_critic_folder(int(fold))],
                                                                           abs=1e-12)
    assert any(np.abs(predictions[0][k] - predictions[1][k]).max() > 1e-6 for k in predictions[0]
               if k != fold_critic_folder(int(fold)))


@pytest.mark.slow
@pytest.mark.usefixtures("on_prefect_server")
@pytest.mark.parametrize("method", ["grpo", "focus"])
def test_an_iteration_whose_every_episode_the_budget_cut_leaves_the_policy_unchanged(tmp_path: Path, method: str):
    """A policy whose episodes outgrow B_tok (seen: GRPO drifting off the menus on the 5-hop chain) gets every main
    episode cut and masked: the update has nothing to train. The run goes on with the policy unchanged (it crashed
    the run, and with it a whole `focus compare` grid). With a critic (seen: `focus_nobranch` at λ = 0 on the chain)
    fit_critic has no return to fit: its values are the flat prior and it commits no critic (it crashed too)."""
    from focus_core.artifacts import ArtifactStore
    from tasks.fit_critic import FLAT_PRIOR
    from tasks.inputs import CRITIC_FOLDER, POLICY_FOLDER
    from tests.test_pipeline import focus

    config = tmp_path / "trap.yaml"
    text = TRAP_CONFIG.format(env="lookup_chain").replace("budget: {", "budget: {tokens_per_iteration: 6, ")
    if method == "grpo":
        text = text.replace("method: focus", "method: grpo") + "acquisition: null\ncritic: null\n"
    config.write_text(text)
    focus("train", "--config", str(config), "--store", str(tmp_path / "runs"), "--run-id", "cut", cwd=tmp_path)
    store = ArtifactStore(tmp_path / "runs")
    assert store.run_info("cut")["status"] == "finished"
    episodes = store.read_table("cut", 0, "rollout", "episodes").to_pylist()
    assert episodes and all(e["budget_cut"] for e in episodes)
    if method == "focus":
        fit = store.manifest("cut", 0, "fit_critic_r0")
        assert CRITIC_FOLDER not in fit.files and fit.figures["returns"] == 0
        values = store.read_table("cut", 0, "fit_critic_r0", "values").to_pylist()
        assert values and all(v["value"] == FLAT_PRIOR[0] and v["n"] == 0 for v in values)
        assert all(a["advantage"] == 0.0 for a in store.read_table("cut", 0, "advantage", "advantages").to_pylist())
    update = store.manifest("cut", 0, "update")
    assert update.figures["steps"] == 0 and update.figures["policy_tokens"] == 0
    assert update.policy_version == 1 and store.read_table("cut", 0, "update", "updates").num_rows == 0
    before, after = (store.fetch_folder("cut", 0, stage, POLICY_FOLDER) for stage in ("bootstrap", "update"))
    weights = sorted(p.name for p in before.glob("*.safetensors"))
    assert weights and weights == sorted(p.name for p in after.glob("*.safetensors"))
    assert all((before / name).read_bytes() == (after / name).read_bytes() for name in weights)
    assert json.loads((after / "focus_policy.json").read_text())["version"] == 1
