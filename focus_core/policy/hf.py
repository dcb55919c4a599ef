"""The ``hf`` backend: a transformers causal LM in this process, sampled with our own KV-cache decode loop.

Why not ``model.generate``: we need (1) log-probabilities at the sampling temperature without the top-p truncation,
log_softmax(logits / T), which is exactly what the trainer recomputes (``ppo.py``), whereas ``generate`` reports
the fully processed scores (the nucleus's −inf included); (2) the ``n`` branches of a prompt to share one forward
pass over the prompt *and one copy of its keys/values*; (3) a random stream per sample, so a branch's tokens
depend on its seed and not on what else is in the batch. The loop:

    prefill   all prompts, left-padded, one forward with explicit position ids; logits of the last position only
    branch    row r of the decode batch is sample r % n of prompt r // n; the prompt K/V stay one copy per prompt
    decode    one token per step for every live row; finished rows leave the batch

Shared-prefix ("cascade") attention: during decoding, each layer attends to the prompt's K/V once for all its
branches (the queries of the n rows are stacked and multiplied against the single prompt copy) and to each
row's own generated K/V separately, then merges the two softmax parts exactly (log-sum-exp). Expanding the cache
to n copies instead (``batch_repeat_interleave``) makes every decode step read the prompt n times: on the 2-core
CI machine, 8 × 64 tokens from a 1,024-token state then took 2.0-2.6x as long as from a 16-token state; with the
shared prefix it is 1.3-1.6x, most of it the one unavoidable prefill (bench/branching.py). It also keeps memory
at one copy of the prompt per state.

``score`` runs the model over prompt + completion in one unpadded forward with its stock attention and returns
log-probs at its ``temperature`` (default 1, untempered); ``score_batch`` scores many completions of many prompts
through their token trie, every distinct prefix computed once. Position ids are explicit in all paths (left
padding would otherwise shift the rotary positions), so the sampler's log-probs and ``score`` at the sampling
temperature agree to float rounding (~1e-6 in fp32; greedy, temperature 0, keeps untempered log-probs), and
``ppo.sequence_logprobs(..., temperature=T)`` is the trainer's matching re-score.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    DynamicCache,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from focus_core.policy.base import Generation, check_sampling_arguments, check_seeds
from focus_core.policy.tokenizer import end_of_turn_ids

# Written next to the Hugging Face files of a checkpoint; carries what HF's own files don't.
METADATA_FILE = "focus_policy.json"
# score_batch feeds the last nodes of a token trie in one row (tree-masked) once at most this many are left.
_PACKED_TAIL = 64
# Our attention implementation, switched on only inside ``generate``; everywhere else (score, training) the model
# runs its stock attention.
BRANCH_ATTENTION = "focus_branch"


class HFPolicy:
    """A Hugging Face causal LM behind the ``Policy`` interface (see ``focus_core.policy.base``).

    Works with decoder-only models whose layers all use full attention through transformers' attention interface
    (Llama, Qwen2/3, Mistral without sliding window, SmolLM2, ...). Others fail here with the reason; serve them
    with the vllm backend.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        device: str | torch.device = "cpu",
        *,
        max_context: int | None = None,
        stop_token_ids: set[int] | None = None,
        version: int = 0,
    ) -> None:
        if not tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat_template; the agent harness renders prompts with it")
        _check_branchable(model)
        self.device = torch.device(device)
        # Models built from a config start in train mode (dropout on); sampling and scoring must not.
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.max_context = int(max_context or model.config.max_position_embeddings)
        self.version = version
        self._stop_token_ids = frozenset(stop_token_ids if stop_token_ids is not None else end_of_turn_ids(tokenizer))
        # Any id works for padding: padded positions are masked out of attention and never read.
        self._pad_id = next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None)
        # transformers 5.2x renamed the forward argument ``past_key_values`` to ``cache``; take whichever exists.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop_token_ids

    # ------------------------------------------------------------------ sampling

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: set[int] | None = None,
        seed: int | Sequence[int] = 0,
        first_sample: Sequence[int] | None = None,
    ) -> list[list[Generation]]:
        self._check_sampling(prompts, n, max_new_tokens, temperature, top_p)
        seeds = [seed] * len(prompts) if isinstance(seed, int) else list(seed)
        firsts = check_seeds(seed, first_sample, len(prompts))
        stops = self._stop_token_ids if stop_token_ids is None else frozenset(stop_token_ids)
        stop_tensor = torch.tensor(sorted(stops), dtype=torch.long, device=self.device)
        # Row r of the decode batch is sample r % n of prompt r // n.
        lengths = torch.tensor([len(p) for p in prompts], device=self.device).repeat_interleave(n)
        budget = torch.clamp(self.max_context - lengths, max=max_new_tokens)  # new tokens each row may add
        generators = [
            torch.Generator().manual_seed(_row_seed(seeds[i], i if isinstance(seed, int) else None, firsts[i] + j))
            for i in range(len(prompts))
            for j in range(n)
        ]
        tokens_out: list[list[int]] = [[] for _ in generators]
        logprobs_out: list[list[float]] = [[] for _ in generators]
        finish: list[str] = ["length"] * len(generators)
        live = torch.arange(len(generators), device=self.device)  # original row of each row still decoding
        next_position = lengths.clone()
        cache = _BranchCache(self.model.config, capacity=int(budget.max()))

        with self._branch_attention():
            logits = self._prefill(prompts, cache).repeat_interleave(n, dim=0)
            cache.branch(n)
            for step in itertools.count(1):
                live_rows = live.tolist()
                tokens = _sample(logits, temperature, top_p, [generators[r] for r in live_rows])
                logprobs = _sampled_logprobs(logits, tokens, temperature)
                for row, token, logprob in zip(live_rows, tokens.tolist(), logprobs.tolist(), strict=True):
                    tokens_out[row].append(token)
                    logprobs_out[row].append(logprob)
                stopped = torch.isin(tokens, stop_tensor)
                for row in live[stopped].tolist():
                    finish[row] = "stop"
                done = stopped | (budget <= step)  # every live row has produced `step` tokens
                if bool(done.all()):
                    break
                if bool(done.any()):
                    # Finished rows leave the batch, so the remaining steps cost only what is still running.
                    keep = (~done).nonzero()[:, 0]
                    cache.keep_rows(keep)
                    live, tokens, next_position, budget = (t[keep] for t in (live, tokens, next_position, budget))
                # The cache masks the prompts' padding itself, so decode steps need no attention mask.
                logits = self._forward(tokens[:, None], None, next_position[:, None], cache)
                next_position = next_position + 1

        generations = [
            Generation(token_ids=t, logprobs=lp, finish_reason=f)
            for t, lp, f in zip(tokens_out, logprobs_out, finish, strict=True)
        ]
        return [generations[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _prefill(self, prompts: Sequence[Sequence[int]], cache: _BranchCache) -> torch.Tensor:
        """One forward over all prompts, left-padded to the longest; the next-token logits of each prompt."""
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((len(prompts), width), dtype=torch.long, device=self.device)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # each prompt starts at position 0 after its padding
        cache.prompt_mask = mask
        padded = bool((mask == 0).any())
        return self._forward(input_ids, mask if padded else None, positions, cache)

    @torch.inference_mode()
    def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], *, temperature: float = 1.0
              ) -> list[float]:
        if not prompt_ids:
            raise ValueError("score: prompt_ids is empty; the first token has no log-probability to condition on")
        _check_score_temperature(temperature)
        if not completion_ids:
            return []
        ids = list(prompt_ids) + list(completion_ids)
        if len(ids) > self.max_context:
            raise ValueError(f"score: {len(ids)} tokens exceed max_context={self.max_context}")
        # The last token is only predicted, never fed; the logits of the last len(completion) fed positions
        # predict exactly the completion tokens.
        inputs = torch.tensor([ids[:-1]], dtype=torch.long, device=self.device)
        positions = torch.arange(len(ids) - 1, device=self.device)[None]
        logits = self._forward(inputs, None, positions, None, keep=len(completion_ids))
        logits = logits.reshape(-1, logits.shape[-1])  # [completion, vocab]; keep=1 drops the position axis
        targets = torch.tensor(list(completion_ids), dtype=torch.long, device=self.device)
        return torch.log_softmax(logits.float() / temperature, dim=-1).gather(1, targets[:, None])[:, 0].tolist()

    @torch.inference_mode()
    def score_batch(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[Sequence[int]]], *,
                    temperature: float = 1.0, memory_bytes: int = 512 << 20) -> list[list[list[float]]]:
        """``result[i][j]`` = ``score(prompts[i], completions[i][j], temperature=temperature)``, for many at once.

        Every distinct prefix is computed once: prompts and their completions form a token trie, whose
        unbranched runs are fed level by level, each level in batched forwards that continue their parents' K/V.
        Contexts that share a system prompt, a task and most of an observation thus cost only what differs.
        Prompts are taken in sorted order, in groups whose K/V stays within about ``memory_bytes``. Agrees with
        ``score`` to float rounding.
        """
        _check_score_temperature(temperature)
        if len(prompts) != len(completions):
            raise ValueError(f"score_batch: {len(prompts)} prompts but {len(completions)} completion lists")
        for prompt, options in zip(prompts, completions, strict=True):
            if not prompt:
                raise ValueError("score_batch: an empty prompt; the first token has no log-probability")
            longest = len(prompt) + max((len(c) for c in options), default=0)
            if longest > self.max_context:
                raise ValueError(f"score_batch: {longest} tokens exceed max_context={self.max_context}")
        result: list[list[list[float]]] = [[[] for _ in options] for options in completions]
        order = sorted((i for i in range(len(prompts)) if any(completions[i])),
                       key=lambda i: tuple(int(t) for t in prompts[i]))
        config = self.model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per_token = 2 * config.num_hidden_layers * heads * head_dim * 4  # K and V, fp32
        group: list[int] = []
        rows, longest = 0, 0
        for i in order:  # a level has at most one row per completion of the group
            wide = max(longest, len(prompts[i]) + max(len(c) for c in completions[i]))
            if group and (rows + len(completions[i])) * wide * per_token > memory_bytes:
                self._score_trie(group, prompts, completions, temperature, result)
                group, rows, wide = [], 0, len(prompts[i]) + max(len(c) for c in completions[i])
            group.append(i)
            rows, longest = rows + len(completions[i]), wide
        if group:
            self._score_trie(group, prompts, completions, temperature, result)
        return result

    def _score_trie(self, group: list[int], prompts: Sequence[Sequence[int]],
                    completions: Sequence[Sequence[Sequence[int]]], temperature: float,
                    result: list[list[list[float]]]) -> None:
        """Score the completions of the prompts ``group`` through their token trie (see ``score_batch``).

        Only nodes with children are fed (the others are only predicted). The trie is cut into rows: an
        unbranched run of nodes, and once the nodes below the run's end are few (``_PACKED_TAIL``), all of them
        in the same row, each attending to its own ancestors only (a tree mask), so the menu of completions
        after a context costs one row. Level by level, rows of similar width are fed together, each continuing
        its parent row's K/V, which is then compacted (valid entries first) so padding is never carried on.
        """
        token, depth, parent, children = [], [], [], []
        roots: dict[int, int] = {}

        def insert(level: dict[int, int], start: int, tokens: Sequence[int], up: int) -> list[int]:
            path = []
            for position, t in enumerate(tokens, start):
                child = level.get(t)
                if child is None:
                    child = level[t] = len(token)
                    token.append(int(t))
                    depth.append(position)
                    parent.append(up)
                    children.append({})
                path.append(child)
                up, level = child, children[child]
            return path

        wanted: list[tuple[int, int, list[tuple[int, int]]]] = []  # (i, j, [(node that predicts, target)])
        previous, previous_path = np.zeros(0, dtype=np.int64), []
        for i in group:  # sorted: a prompt's path starts with the part it shares with the one before
            current = np.asarray(prompts[i], dtype=np.int64)
            shared = min(len(current), len(previous))
            differ = np.flatnonzero(current[:shared] != previous[:shared])
            shared = int(differ[0]) if len(differ) else shared
            level = children[previous_path[shared - 1]] if shared else roots
            up = previous_path[shared - 1] if shared else -1
            previous_path = previous_path[:shared] + insert(level, shared, current[shared:].tolist(), up)
            previous = current
            end = previous_path[-1]
            for j, completion in enumerate(completions[i]):
                if completion:
                    path = [end, *insert(children[end], len(prompts[i]), completion, end)]
                    wanted.append((i, j, [(path[k], int(t)) for k, t in enumerate(completion)]))
        needed: dict[int, set[int]] = {}  # node -> the tokens whose log-probability after it is wanted
        for _, _, pairs in wanted:
            for node, target in pairs:
                needed.setdefault(node, set()).add(target)
        scores: dict[tuple[int, int], float] = {}
        below = [0] * len(token)  # fed nodes strictly below each node (children are created after parents)
        for n in reversed(range(len(token))):
            below[n] = sum(below[c] + 1 for c in children[n].values() if children[c])

        def fed_subtree(n: int) -> list[int]:
            out, stack = [], [c for c in reversed(children[n].values()) if children[c]]
            while stack:
                node = stack.pop()
                out.append(node)
                stack += [c for c in reversed(children[node].values()) if children[c]]
            return out

        rows: list[list[int]] = []  # the nodes of each row, parents before children
        row_parent: list[int] = []  # the row whose K/V it continues (-1: none)
        row_run: list[int] = []  # how many leading nodes of each row form its unbranched run
        handing: set[int] = set()  # rows that later rows continue (their nodes are a run: no packed tail)
        levels: list[list[int]] = []
        frontier = [(n, -1) for n in roots.values() if children[n]]
        while frontier:
            levels.append([])
            next_frontier = []
            for head, parent_row in frontier:
                run = [head]
                while len(children[run[-1]]) == 1 and below[run[-1]] > _PACKED_TAIL:
                    run.append(next(iter(children[run[-1]].values())))
                tail = fed_subtree(run[-1]) if below[run[-1]] <= _PACKED_TAIL else []
                row = len(rows)
                rows.append(run + tail)
                row_parent.append(parent_row)
                row_run.append(len(run))
                levels[-1].append(row)
                continuing = [] if tail else [(c, row) for c in children[run[-1]].values() if children[c]]
                if continuing:
                    handing.add(row)
                next_frontier += continuing
            frontier = next_frontier

        decoder, head_layer = self.model.get_decoder(), self.model.get_output_embeddings()
        cache_arg = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
        layers = self.model.config.num_hidden_layers
        past: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer [rows, heads, length, dim]
        past_count = torch.zeros(0, dtype=torch.long)  # valid (left-aligned) entries per row
        past_row: dict[int, int] = {}
        for members in levels:
            members.sort(key=lambda r: len(rows[r]))
            buckets, current = [], []
            for r in members:  # similar widths together: padding costs compute only inside a bucket
                if current and (len(rows[r]) > 1.25 * len(rows[current[0]]) + 2 or len(current) >= 512):
                    buckets.append(current)
                    current = []
                current.append(r)
            buckets.append(current)
            handing_on = [r for r in members if r in handing]  # rows whose K/V the next level needs
            next_index = {r: k for k, r in enumerate(handing_on)}
            parents = torch.tensor([past_row[row_parent[r]] for r in members]) if past else None
            prefix_counts = past_count[parents] if past else torch.zeros(len(members), dtype=torch.long)
            place = {r: k for k, r in enumerate(members)}
            counts = torch.tensor([int(prefix_counts[place[r]]) + len(rows[r]) for r in handing_on], dtype=torch.long)
            span = int(counts.max()) if len(counts) else 0
            level_past: list[tuple[torch.Tensor, torch.Tensor]] = []
            for bucket in buckets:
                where = torch.tensor([place[r] for r in bucket])
                width = len(rows[bucket[-1]])
                ids = torch.full((len(bucket), width), self._pad_id, dtype=torch.long)
                positions = torch.zeros((len(bucket), width), dtype=torch.long)
                tree = np.zeros((len(bucket), width, width), dtype=bool)
                causal = np.tril(np.ones((width, width), dtype=bool))
                for b, r in enumerate(bucket):
                    nodes, run = rows[r], row_run[r]
                    ids[b, : len(nodes)] = torch.tensor([token[n] for n in nodes])
                    positions[b, : len(nodes)] = torch.tensor([depth[n] for n in nodes])
                    tree[b, :run, :run] = causal[:run, :run]  # the run: plain causal attention
                    local = {n: q for q, n in enumerate(nodes)}
                    for q in range(run, len(nodes)):  # the packed tail: each node sees its ancestors
                        tree[b, q] = tree[b, local[parent[nodes[q]]]]
                        tree[b, q, q] = True
                    tree[b, range(len(nodes), width), range(len(nodes), width)] = True  # padding sees itself
                tree = torch.from_numpy(tree)
                prefix_count = prefix_counts[where]
                prefix_width = past[0][0].shape[2] if past else 0
                cache = DynamicCache(config=self.model.config)
                if past:
                    for layer in range(layers):
                        cache.update(past[layer][0][parents[where]], past[layer][1][parents[where]], layer)
                valid = torch.arange(prefix_width)[None] < prefix_count[:, None]
                mask = torch.cat([valid[:, None, :].expand(-1, width, -1), tree], dim=2)[:, None]
                hidden = decoder(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                 position_ids=positions.to(self.device), use_cache=True,
                                 **{cache_arg: cache}).last_hidden_state
                picks = [(b, q, n) for b, r in enumerate(bucket) for q, n in enumerate(rows[r]) if n in needed]
                if picks:
                    pick_rows = torch.tensor([b for b, _, _ in picks], device=self.device)
                    pick_columns = torch.tensor([q for _, q, _ in picks], device=self.device)
                    logits = torch.log_softmax(head_layer(hidden[pick_rows, pick_columns]).float() / temperature, -1)
                    pairs = [(k, n, t) for k, (_, _, n) in enumerate(picks) for t in needed[n]]
                    chosen = logits[torch.tensor([k for k, _, _ in pairs]), torch.tensor([t for _, _, t in pairs])]
                    scores.update(zip([(n, t) for _, n, t in pairs], chosen.tolist(), strict=True))
                keep = [(b, r) for b, r in enumerate(bucket) if r in next_index]
                if not keep:
                    continue
                # Compact into the next level's K/V: each kept row's valid prefix entries, then its run's.
                kept = torch.tensor([b for b, _ in keep])
                targets = torch.tensor([next_index[r] for _, r in keep])
                kept_count = prefix_count[kept]
                kept_span = int(counts[targets].max())
                slot = torch.arange(kept_span)[None]
                gather = torch.where(slot < kept_count[:, None], slot, prefix_width + slot - kept_count[:, None])
                gather = gather.clamp(max=prefix_width + width - 1).to(self.device)
                for layer in range(layers):
                    keys, values = cache.layers[layer].keys[kept], cache.layers[layer].values[kept]
                    if len(level_past) == layer:
                        shape = (len(handing_on), keys.shape[1], span, keys.shape[3])
                        level_past.append((keys.new_zeros(shape), values.new_zeros(shape)))
                    index = gather[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
                    level_past[layer][0][targets, :, :kept_span] = keys.gather(2, index)
                    level_past[layer][1][targets, :, :kept_span] = values.gather(2, index)
            past, past_count, past_row = level_past, counts, next_index
        for i, j, pairs in wanted:
            result[i][j] = [scores[pair] for pair in pairs]

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        cache: _BranchCache | None,
        keep: int = 1,
    ) -> torch.Tensor:
        """Logits of the last ``keep`` positions ([batch, vocab] when keep=1). No mask means no padding, which
        lets attention take its fast causal path."""
        extra = {} if cache is None else {self._cache_arg: cache, "branch_cache": cache}
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=cache is not None,
            logits_to_keep=keep,
            **extra,
        )
        return out.logits[:, -1] if keep == 1 else out.logits

    @contextlib.contextmanager
    def _branch_attention(self) -> Iterator[None]:
        """Run the model with the shared-prefix attention, then give it back its own."""
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(BRANCH_ATTENTION)
        try:
            yield
        finally:
            self.model.set_attn_implementation(previous)

    def _check_sampling(
        self, prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int, temperature: float, top_p: float
    ) -> None:
        check_sampling_arguments(prompts, n, max_new_tokens, temperature, top_p, self.max_context)

    # ------------------------------------------------------------------ checkpoints

    def save(self, path: str | Path) -> None:
        """Write model (safetensors), tokenizer and version to ``path``, replacing it; a crash leaves no partial
        folder (everything is written to a sibling temp folder that is renamed at the end)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        staging.chmod(0o755)  # mkdtemp makes it private; a checkpoint is read by other processes and users
        try:
            self.model.save_pretrained(staging)
            self.tokenizer.save_pretrained(staging)
            write_version(staging, self.version)
            if path.exists():
                shutil.rmtree(path)
            os.replace(staging, path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def load_weights(self, path: str | Path, version: int | None = None) -> None:
        """Load the weights of a checkpoint folder into this model (same architecture).

        ``version`` defaults to the one saved with the checkpoint, else the current version + 1. Only the model's
        own files are read (``model.safetensors``, or its shards ``model-*-of-*.safetensors``): a checkpoint folder
        may also hold other safetensors, such as the optimizer state and a value head.
        """
        path = Path(path)
        files = sorted(path.glob("model*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"load_weights: no model*.safetensors in {path} (expected a folder written by save)"
            )
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(file, device=str(self.device)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        # Tied weights (lm_head = embeddings) are stored once; every other parameter must be in the checkpoint.
        tied = set(self.model._tied_weights_keys or ()) if self.model.config.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise ValueError(
                f"load_weights: {path} does not match this model: missing {sorted(set(missing) - tied)}, "
                f"unexpected {sorted(unexpected)}"
            )
        self.model.eval()
        self.version = version if version is not None else read_version(path, default=self.version + 1)


def _check_score_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"score: temperature={temperature} must be > 0 (log-probs at temperature T are "
                         "log_softmax(logits / T); greedy decoding has no distribution to score)")


def write_version(path: str | Path, version: int) -> None:
    """Record the policy version in a checkpoint folder (what ``read_version`` reads)."""
    (Path(path) / METADATA_FILE).write_text(json.dumps({"version": version}))


def read_version(path: str | Path, default: int = 0) -> int:
    """The policy version saved with a checkpoint folder, or ``default`` for a folder without one."""
    metadata = Path(path) / METADATA_FILE
    return int(json.loads(metadata.read_text())["version"]) if metadata.exists() else default


# ---------------------------------------------------------------------- shared-prefix attention


class _BranchLayer(DynamicLayer):
    """One layer's K/V: the prompts' (one copy per prompt, left-padded) and each row's generated tokens."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity  # generated tokens to hold per row: preallocated, written in place
        self.branched = False
        self.prefix_keys: torch.Tensor | None = None
        self.prefix_values: torch.Tensor | None = None
        self.generated = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.branched:  # the prefill: keep the prompts' K/V; attention over them is the stock one
            # Contiguous copies: the projections hand over transposed views, which every decode step would
            # otherwise read with a strided (several times slower) matmul.
            self.prefix_keys, self.prefix_values = key_states.contiguous(), value_states.contiguous()
            self.keys, self.values, self.is_initialized = self.prefix_keys, self.prefix_values, True
            return self.keys, self.values
        if self.generated == 0:
            # One in-place write per token instead of torch.cat, which would copy the cache every step.
            shape = (*key_states.shape[:2], self.capacity, key_states.shape[-1])
            self._key_store, self._value_store = key_states.new_empty(shape), value_states.new_empty(shape)
        if self.generated >= self.capacity:
            raise RuntimeError(f"branch cache: more than {self.capacity} generated tokens per row")
        self._key_store[:, :, self.generated] = key_states[:, :, 0]
        self._value_store[:, :, self.generated] = value_states[:, :, 0]
        self.generated += 1
        self._refresh_views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return (0 if self.prefix_keys is None else self.prefix_keys.shape[-2]) + self.generated

    def keep(self, rows: torch.Tensor, prompts: torch.Tensor | None) -> None:
        if self.generated:
            self._key_store, self._value_store = self._key_store[rows], self._value_store[rows]
            self._refresh_views()
        if prompts is not None:
            self.prefix_keys, self.prefix_values = self.prefix_keys[prompts], self.prefix_values[prompts]

    def _refresh_views(self) -> None:
        self.keys = self._key_store[:, :, : self.generated]
        self.values = self._value_store[:, :, : self.generated]


class _BranchCache(DynamicCache):
    """A decode cache for prompts that fan out into rows, with the attention that reads it (see module doc)."""

    def __init__(self, config: PretrainedConfig, capacity: int) -> None:
        super().__init__(config=config)
        self.layers = [_BranchLayer(capacity) for _ in self.layers]
        self.branched = False
        self.prompt_mask: torch.Tensor | None = None

    def branch(self, n: int) -> None:
        """After the prefill (which set ``prompt_mask``: [prompts, width], 1 = token): ``n`` rows per prompt."""
        mask = self.prompt_mask
        self.row_prompt = torch.arange(len(mask), device=mask.device).repeat_interleave(n)
        # Additive attention bias that hides each prompt's left padding.
        self.prefix_bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        self.prefix_bias = self.prefix_bias.masked_fill(mask == 0, float("-inf"))[:, None, None, :]
        self.padded = bool((mask == 0).any())
        self.branched = True
        for layer in self.layers:
            layer.branched = True
        self._index_rows()

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (sorted); prompts left without rows are dropped too."""
        self.row_prompt = self.row_prompt[rows]
        alive = torch.unique(self.row_prompt)
        prompts = None
        if len(alive) < self.prefix_bias.shape[0]:
            prompts, self.prefix_bias = alive, self.prefix_bias[alive]
            self.row_prompt = torch.searchsorted(alive, self.row_prompt)
        for layer in self.layers:
            layer.keep(rows, prompts)
        self._index_rows()

    def _index_rows(self) -> None:
        """Lay rows out as a [prompts, slots] grid so one batched matmul serves all branches of all prompts.

        Rows are grouped by prompt (the initial layout, which ``keep_rows`` preserves); a prompt with fewer live
        rows than the widest leaves slots that point at row 0 and whose results are never read.
        """
        counts = torch.bincount(self.row_prompt, minlength=self.prefix_bias.shape[0])
        self.slots_per_prompt = int(counts.max())
        first_row = counts.cumsum(0) - counts
        rank = torch.arange(len(self.row_prompt), device=counts.device) - first_row[self.row_prompt]
        self.slot_of_row = self.row_prompt * self.slots_per_prompt + rank
        slots = torch.zeros(len(counts) * self.slots_per_prompt, dtype=torch.long, device=counts.device)
        slots[self.slot_of_row] = torch.arange(len(self.row_prompt), device=counts.device)
        self.row_of_slot = slots.view(len(counts), self.slots_per_prompt)

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of one new token per row over its prompt and its own generated tokens.

        ``query``: [rows, q_heads, 1, head_dim] → output [rows, 1, q_heads, head_dim] (what attention
        functions return). Query heads are grouped by their KV head (GQA) instead of repeating K/V.
        """
        layer = self.layers[layer_idx]
        rows, q_heads, q_len, dim = query.shape
        if q_len != 1:
            raise RuntimeError("branch cache: decode steps feed one token per row")
        kv_heads = layer.prefix_keys.shape[1]
        group = q_heads // kv_heads
        query = query.reshape(rows, kv_heads, group, dim) * scaling  # scale the few queries, not the many scores

        # Prompt part: each prompt's K/V is read once for all of its rows.
        prompts, slots = self.row_of_slot.shape
        grid = query[self.row_of_slot].transpose(1, 2).reshape(prompts, kv_heads, slots * group, dim)
        scores = grid @ layer.prefix_keys.transpose(-1, -2)
        if self.padded:
            scores += self.prefix_bias.to(scores.dtype)
        prefix = _partial_softmax(scores, layer.prefix_values)
        # Back from the grid to rows: [prompts, kv, slots·group, x] → [rows, kv, group, x].
        prefix = [
            t.view(prompts, kv_heads, slots, group, -1).transpose(1, 2).reshape(prompts * slots, kv_heads, group, -1)
            for t in prefix
        ]
        prefix = [t[self.slot_of_row] for t in prefix]
        # Generated part: every row's own tokens (the current one included, so never empty).
        own = _partial_softmax(query @ layer.keys.transpose(-1, -2), layer.values)
        # Merge the two partial softmaxes exactly.
        (max_a, sum_a, out_a), (max_b, sum_b, out_b) = prefix, own
        top = torch.maximum(max_a, max_b)
        weight_a, weight_b = torch.exp(max_a - top), torch.exp(max_b - top)
        out = (out_a * weight_a + out_b * weight_b) / (sum_a * weight_a + sum_b * weight_b)
        return out.reshape(rows, q_heads, dim)[:, None]


def _partial_softmax(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row max, sum of exp(score - max), unnormalised exp(score - max) @ values) of one block of keys."""
    top = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(top).exp_()  # in place: scores are a temporary of the caller
    return top, weights.sum(dim=-1, keepdim=True), weights @ values


def _branch_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Registered as ``focus_branch``: shared-prefix attention while decoding branches, stock SDPA otherwise."""
    cache = kwargs.get("branch_cache")
    if cache is None or not cache.branched:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    for feature in ("softcap", "s_aux", "sliding_window"):
        if kwargs.get(feature) is not None:
            raise NotImplementedError(f"the hf backend's branch attention does not support {feature}; use vllm")
    return cache.attend(module.layer_idx, query, scaling), None


AttentionInterface.register(BRANCH_ATTENTION, _branch_attention_forward)
AttentionMaskInterface.register(BRANCH_ATTENTION, sdpa_mask)


def _check_branchable(model: PreTrainedModel) -> None:
    layers = DynamicCache(config=model.config).layers
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        raise NotImplementedError(
            f"{type(model).__name__}: the hf backend needs full attention in every layer (no sliding-window, "
            "linear or shared-KV layers); use the vllm backend for this model"
        )
    if not model._can_set_attn_implementation():
        raise NotImplementedError(f"{type(model).__name__} does not use transformers' attention interface")


# ---------------------------------------------------------------------- sampling


def _row_seed(seed: int, prompt_index: int | None, sample_index: int) -> int:
    """A 63-bit seed for one sample's random stream, stable across processes and Python versions."""
    key = f"{seed}:{prompt_index}:{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 log_softmax(logits / temperature) of the drawn tokens: the distribution ``_sample`` draws from, before
    its top-p truncation (the trainer cannot reproduce a nucleus that moves with the weights; see ``ppo.py``).
    Greedy decoding (temperature 0) has no distribution and keeps the untempered log-probs."""
    scaled = logits.float() if temperature == 0 else logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None])[:, 0]


def _sample(logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row from softmax(logits / temperature), truncated to the top-p nucleus.

    Inverse-CDF sampling with one uniform per row drawn from that row's own generator, so each row's draw is
    independent of the batch it sits in.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    order = None
    if top_p < 1:
        probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it already does.
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, 0.0)
    cdf = probs.cumsum(dim=-1)
    uniform = torch.stack([torch.rand((), generator=g) for g in generators]).to(cdf.device)
    picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)[:, 0]
    # Rounding can put u·total at the total itself; fall back to the last token with non-zero probability.
    picked = torch.minimum(picked, (cdf < cdf[:, -1:]).sum(dim=-1))
    return picked if order is None else order.gather(1, picked[:, None])[:, 0]
