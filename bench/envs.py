"""The embedded agent environments, measured through the agent harness.

For each environment (default tier): task counts per split, the scripted expert's and a random
agent's held-out success, and the expert's median turns and generated/total tokens per episode,
counted with a byte-level BPE tokenizer trained on the environment's own expert transcripts (the
tokenizer the tiny default model uses). Episodes run through ``AgentRunner`` with the default
``AgentConfig``, so compression and turn limits apply as in training.

    python bench/envs.py --json bench/out/envs.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench import emit_json
from focus_core.agent.harness import AgentRunner
from focus_core.agent.scripted import ScriptedActor
from focus_core.config import AgentConfig
from focus_core.envs import make_env
from focus_core.policy.tokenizer import END, train_tokenizer

ENVIRONMENTS = ("deep_search", "code_localization", "legal")


def measure(name: str, episodes: int, seed: int) -> dict:
    env = make_env(name)
    train, heldout = env.tasks("train"), env.tasks("heldout")
    rng = np.random.default_rng(seed)
    sample = [heldout[i] for i in rng.choice(len(heldout), size=min(episodes, len(heldout)), replace=False)]
    config = AgentConfig(max_turns=24)

    def factory():
        return make_env(name)

    # The tokenizer is trained on expert text of *train* tasks only, as the tiny model's would be.
    bootstrap = train_tokenizer([env.system_prompt(), *(t.prompt for t in train[:200])], vocab_size=512)
    end_id = bootstrap.convert_tokens_to_ids(END)
    warmup = AgentRunner(ScriptedActor(bootstrap, end_id), factory, config).run(train[:200])
    tokenizer = train_tokenizer([env.system_prompt(), *(turn.text for e in warmup for turn in e.turns)])
    end_id = tokenizer.convert_tokens_to_ids(END)

    started = time.perf_counter()
    expert = AgentRunner(ScriptedActor(tokenizer, end_id, seed=seed), factory, config).run(sample)
    random = AgentRunner(ScriptedActor(tokenizer, end_id, mistake_rate=1.0, seed=seed), factory, config).run(sample)
    return {
        "env": name,
        "train_tasks": len(train),
        "heldout_tasks": len(heldout),
        "episodes": len(sample),
        "expert_success": float(np.mean([e.reward for e in expert])),
        "random_success": float(np.mean([e.reward for e in random])),
        "median_turns": float(np.median([e.n_tool_calls for e in expert])),
        "median_tokens": float(np.median([sum(len(t.token_ids) for t in e.turns) for e in expert])),
        "median_generated_tokens": float(np.median([e.generated_tokens for e in expert])),
        "median_segments": float(np.median([e.n_segments for e in expert])),
        "max_context_tokens": max(sum(len(t.token_ids) for t in e.turns if t.segment_idx == k)
                                  for e in expert for k in range(e.n_segments)),
        "seconds": time.perf_counter() - started,
    }


def write_transcript(name: str, directory: Path, seed: int) -> Path:
    """One held-out expert episode as markdown, with the compression turns the tiny default sees."""
    env = make_env(name)
    task = env.tasks("heldout")[seed % len(env.tasks("heldout"))]
    tokenizer = train_tokenizer([env.system_prompt(), task.prompt], vocab_size=300)
    runner = AgentRunner(ScriptedActor(tokenizer, tokenizer.convert_tokens_to_ids(END), seed=seed),
                         lambda: make_env(name), AgentConfig(max_turns=24, compression="notes"))
    episode = runner.run([task])[0]
    lines = [f"# `{name}`: held-out task {task.task_id} (reward {episode.reward:g})", "",
             "System prompt:", "", "```text", env.system_prompt(), "```", ""]
    for turn in episode.turns:
        label = {"context": "context (segment start)" if turn.segment_idx else "task",
                 "policy": "policy", "tool": "tool", "summary": "summary"}[turn.role]
        lines += [f"**{label}** (segment {turn.segment_idx})", "", "```text", turn.text, "```", ""]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", nargs="+", default=list(ENVIRONMENTS), choices=ENVIRONMENTS)
    parser.add_argument("--episodes", type=int, default=100, help="held-out tasks per environment")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--transcripts", type=Path, help="also write one expert transcript per environment here")
    args = parser.parse_args(argv)
    if args.transcripts:
        for name in args.envs:
            print(f"wrote {write_transcript(name, args.transcripts, args.seed)}")
    results = [measure(name, args.episodes, args.seed) for name in args.envs]
    emit_json({"results": results}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
