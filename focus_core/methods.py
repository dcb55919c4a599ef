"""The method table: every training method as one row of the same pipeline.

A method is a choice of four things, and nothing else differs between methods (the stages read
these rows; they never test a method's name):

* ``estimator`` — the advantage estimator, a key of ``focus_core.advantages.ADVANTAGE_ESTIMATORS``;
* ``values`` — where the baseline V(s) comes from: ``critic`` (the ensemble, cross-fitted and
  combined with continuation returns), ``monte_carlo`` (continuation means only), ``value_head``
  (a token-level head on the policy, trained with the policy) or ``group`` (the other episodes of
  the prompt's group);
* ``branching`` — the acquisition strategy that spends the continuation budget, or None for a method
  that does not branch. ``strategy_fixed`` says whether the method *is* that rule (VinePPO) or only
  defaults to it (FOCUS, whose strategy is a knob);
* ``presets`` — settings of other config sections the method implies (filled only where the user
  gave none).

How a method fills the matched budget follows from ``branching``: a method that branches runs
P·G_main main episodes and spends the rest of B_tok on continuations; one that does not samples
whole groups of G_grpo episodes, for further prompts, until the next group would not fit.

Adding a method is a row here plus, if it needs one, its estimator in ``advantages.py``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal

ValueSource = Literal["critic", "monte_carlo", "value_head", "group"]


@dataclass(frozen=True)
class Method:
    name: str
    estimator: str
    values: ValueSource
    branching: str | None  # acquisition strategy; None: no continuations
    summary: str  # one line for the method table of docs/pipeline.md
    strategy_fixed: bool = False  # the strategy is the method (VinePPO), not a knob
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)
    requires: dict[str, Any] = field(default_factory=dict)  # "section.field" -> value the method needs
    ablates: str | None = None  # the method this row takes a part out of: `focus report` lists it with that
    #                             method's ablations, not among the baselines

    @property
    def uses_critic(self) -> bool:
        """Fits the ensemble critic (stage fit_critic trains it)."""
        return self.values == "critic"

    @property
    def uses_branches(self) -> bool:
        return self.branching is not None


METHOD_TABLE: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    if method.name in METHOD_TABLE:
        raise ValueError(f"method {method.name!r} is registered twice")
    METHOD_TABLE[method.name] = method
    return method


register_method(Method(
    "focus", "segment_td_lambda", "critic", "novelty",
    "TD(λ) over compression segments; V̂ = cross-fitted critic ensemble ⊕ continuation returns; "
    "continuations where observed returns are scarcest (novelty)",
    presets={"ppo": {"train_on_continuations": True}},  # every generated token trains, as in Tree-GRPO/TreeRL
))
# VinePPO spreads its budget once: with no critic to refit, more rounds would change nothing. Its paper
# uses the continuations for values only, so they do not train the policy.
register_method(Method(
    "vineppo", "vineppo", "monte_carlo", "uniform_all",
    "TD(0) with Monte-Carlo values: K continuations per state, s_0 pooled over the prompt's group",
    strategy_fixed=True, presets={"acquisition": {"rounds": 1}, "ppo": {"train_on_continuations": False}},
))
# Group-relative advantages are already normalised per group: no second whitening over the batch.
register_method(Method(
    "grpo", "grpo", "group", None, "outcome advantage (r − mean_g) / std_g, every token of the episode",
    presets={"advantage": {"whiten": False}},
))
register_method(Method(
    "dr_grpo", "dr_grpo", "group", None, "r − mean_g (no std), loss summed over tokens / a constant",
    presets={"advantage": {"whiten": False}, "ppo": {"loss_agg": "constant", "constant_normaliser": 256}},
    requires={"ppo.loss_agg": "constant"},
))
register_method(Method(
    "rloo", "rloo", "group", None, "leave-one-out baseline r − mean_{j≠i} r_j",
    presets={"advantage": {"whiten": False}},
))
register_method(Method(
    "ppo_gae", "gae", "value_head", None,
    "PPO with a token-level value head on the policy; GAE over policy tokens, tool tokens masked",
    presets={"advantage": {"lam": 0.95}},
))
# The ablation of FOCUS's branching: the same critic and advantages, the whole budget on main rollouts. It asks
# what the continuations buy at a matched budget, and with exact_values what per-state credit is worth when it
# costs no rollouts (docs/benchmarks.md, "What a perfect critic would buy").
register_method(Method(
    "focus_nobranch", "segment_td_lambda", "critic", None,
    "FOCUS without continuations: TD(λ) over compression segments with the critic ensemble fitted on the main "
    "rollouts' returns alone, which take GRPO's whole groups",
    ablates="focus",
))

METHODS: tuple[str, ...] = tuple(METHOD_TABLE)


def get_method(name: str) -> Method:
    try:
        return METHOD_TABLE[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; allowed: {', '.join(METHOD_TABLE)}") from None


def method_defaults(name: str) -> dict[str, dict[str, Any] | None]:
    """The section settings a method implies; a section mapped to None is not used by the method."""
    method = get_method(name)
    sections: dict[str, dict[str, Any] | None] = {
        "advantage": {"estimator": method.estimator},
        "acquisition": {"strategy": method.branching} if method.uses_branches else None,
        "critic": {} if method.uses_critic else None,
    }
    for section, settings in method.presets.items():
        base = sections.get(section) or {}
        sections[section] = {**base, **copy.deepcopy(settings)}
    return sections


def method_family(name: str) -> str:
    """The method a row belongs to in a comparison: the one it ablates, else itself."""
    method = METHOD_TABLE.get(name)
    if method is None or method.ablates is None:
        return name
    return method.ablates


def method_table_markdown() -> str:
    """The method table of docs/pipeline.md, generated from the registry (a test checks the page holds it)."""
    lines = ["| method | advantage estimator | V(s) from | continuations | what it is |", "|---|---|---|---|---|"]
    for m in METHOD_TABLE.values():
        branching = "—" if m.branching is None else f"`{m.branching}`" + ("" if m.strategy_fixed else " (default)")
        lines.append(f"| `{m.name}` | `{m.estimator}` | {m.values} | {branching} | {m.summary} |")
    return "\n".join(lines)
