"""Stage 2 — segment: one state per segment start s_k of every main episode, with critic features.

Segments end at the context manager's compression boundaries, so each state is a compressed context
the policy actually restarted from. The critic's features are the policy's mean-pooled hidden
states over that context (``features.policy_context_features``) plus the segment index, computed once
here with the policy that generated the rollouts.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from focus_core.artifacts import Manifest
from focus_core.features import state_features
from focus_core.rollouts import states_table
from focus_core.schemas import FLOATS
from tasks.inputs import policy_at, read
from tasks.stage import RunContext, StageResult, run_stage, stage_task

STAGE = "segment"
READS = ()  # what it computes follows from its upstream stages alone


def compute(ctx: RunContext, rollout: Manifest, policy_manifest: Manifest, scratch: Path) -> StageResult:
    states = states_table(read(ctx, rollout, "rollouts"), read(ctx, rollout, "episodes"))
    policy = policy_at(ctx, policy_manifest)
    contexts = states.column("context_token_ids").to_pylist()
    features = state_features(policy.model, contexts, states.column("segment_idx").to_numpy())
    column = states.schema.get_field_index("features")
    states = states.set_column(column, states.schema.field("features"), pa.array(list(features), type=FLOATS))
    episodes = len(set(states.column("episode_id").to_pylist()))
    figures = {"states": states.num_rows, "distinct_states": len(set(states.column("state_id").to_pylist())),
               "mean_segments": states.num_rows / max(1, episodes)}
    return StageResult(tables={"states": states}, figures=figures, policy_version=rollout.policy_version)


@stage_task("segment")
def segment(ctx: RunContext, iteration: int, rollout: Manifest, policy: Manifest) -> Manifest:
    return run_stage(ctx, iteration, STAGE, depends_on=ctx.fields(*READS),
                     upstream={"rollout": rollout, "policy": policy},
                     compute=lambda scratch: compute(ctx, rollout, policy, scratch))
